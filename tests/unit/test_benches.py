"""Every benchmark still imports and has its `main`: benches are not run by CI (they take
minutes and measure this machine), so one that no longer fits the code it measures would
otherwise rot unseen until someone runs it. mypy checks them too (`files` in pyproject)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "kit.py")


def test_the_benches_are_found() -> None:
    assert len(SCRIPTS) >= 14, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_bench_imports_and_has_a_main(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/NAME.py` has it
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
