"""One owner per state dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelfleet.host.statedir import StateDirBusy, StateDirLock


def test_a_second_owner_is_refused_with_the_first_named_until_it_lets_go(tmp_path: Path) -> None:
    first = StateDirLock(tmp_path / "agent", "the agent of n1").acquire()
    with pytest.raises(StateDirBusy) as refused:
        StateDirLock(tmp_path / "agent", "the agent of n1").acquire()
    assert f"the agent of n1 pid {os.getpid()}" in str(refused.value)
    first.release()
    StateDirLock(tmp_path / "agent", "the agent of n1").acquire().release()
