"""ctl's own options are taken once, and may be written before or after the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelfleet import __version__
from modelfleet.ctl.commands import with_options_first


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nodes", "-o", "json"], ["-o", "json", "nodes"]),
        (["nodes", "-ojson"], ["-ojson", "nodes"]),
        (
            ["catalog", "apply", "f.yaml", "--dry-run", "--admin", "http://cp", "--token=t"],
            ["--admin", "http://cp", "--token=t", "catalog", "apply", "f.yaml", "--dry-run"],
        ),
        (
            ["--state-dir", "d", "replicas", "show", "r-1"],
            ["--state-dir", "d", "replicas", "show", "r-1"],
        ),
        (
            ["drain", "n1", "--grace", "30", "--output", "table"],
            ["--output", "table", "drain", "n1", "--grace", "30"],
        ),
        (["explain-placement", "--", "-o"], ["explain-placement", "--", "-o"]),
    ],
)
def test_ctl_options_move_before_the_command(args: list[str], expected: list[str]) -> None:
    assert with_options_first(args) == expected


def test_the_version_and_where_ctl_looked_for_the_fleet(tmp_path: Path) -> None:
    """`modelfleet --version` was missing; a ctl that finds no up.json names the folder it
    looked in and how to point it elsewhere."""
    shown = subprocess.run(
        [sys.executable, "-m", "modelfleet", "--version"], capture_output=True, text=True
    )
    assert shown.returncode == 0 and shown.stdout.strip() == f"modelfleet {__version__}"
    lost = subprocess.run(
        [sys.executable, "-m", "modelfleet", "ctl", "nodes"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")},
    )
    assert lost.returncode == 1
    assert str(tmp_path / ".modelfleet") in lost.stderr and "--state-dir" in lost.stderr
