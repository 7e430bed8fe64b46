"""The tests test the checkout they run in, in-process and in every process they start, not
whichever modelfleet is installed (issue 42: a run in a clone made to try a mutation tested
the installed tree of another checkout, and passed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import modelfleet

CHECKOUT_SRC = Path(__file__).resolve().parent.parent.parent / "src"


def test_this_process_and_its_children_import_this_checkout() -> None:
    assert Path(modelfleet.__file__).resolve().is_relative_to(CHECKOUT_SRC)
    child = subprocess.run(
        [sys.executable, "-c", "import modelfleet; print(modelfleet.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert Path(child.stdout.strip()).resolve().is_relative_to(CHECKOUT_SRC), child.stdout
