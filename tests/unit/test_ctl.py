"""ctl's own options are taken once, and may be written before or after the command."""

from __future__ import annotations

import pytest

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
