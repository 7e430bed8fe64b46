"""CPU nodes: an agent offers its cores as slots, a vLLM on them binds its threads to its own
slots' cores, and the pin runs an engine on its cores alone, keeping its pid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.agent.gpus import BadGpuSpec, CpuSlots
from modelfleet.agent.pin import pinned
from modelfleet.engines.base import BadCores, core_list, parse_cores

from .test_engines import launch, shard
from .test_engines import vllm_module as vllm


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_core_list_reads_back_as_written(cores: set[int]) -> None:
    assert parse_cores(core_list(cores)) == tuple(sorted(cores))


def test_core_lists_as_linux_writes_them() -> None:
    assert core_list([8, 0, 1, 2, 3, 5]) == "0-3,5,8"
    assert parse_cores("0-3,8") == (0, 1, 2, 3, 8)
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(BadCores):
            parse_cores(bad)


def test_slots_share_out_the_cores_and_memory() -> None:
    slots = CpuSlots("4", cores=range(10), memory_total=64 << 30)
    assert slots.slots == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}  # 8 and 9 make no slot
    assert [(g.index, g.model, g.memory_total) for g in slots.gpus()] == [
        (0, "CPU", 32 << 30), (1, "CPU", 32 << 30)]  # fmt: skip
    sized = CpuSlots("2x16GB", cores=[3, 1, 7, 5])
    assert sized.slots == {0: (1, 3), 1: (5, 7)}
    assert {g.memory_total for g in sized.gpus()} == {16 * 10**9}
    own = CpuSlots("1")  # this agent's own cores
    assert sorted(sum(own.slots.values(), ())) == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("spec", "said"),
    [("0", "CORES"), ("x", "CORES"), ("4xlots", "lots"), ("9", "may run on 8 only")],
)
def test_bad_slots_say_what_is_wrong(spec: str, said: str) -> None:
    with pytest.raises(BadGpuSpec, match=said):
        CpuSlots(spec, cores=range(8))


def test_vllm_binds_each_rank_to_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "executable", lambda name: f"/usr/bin/{name}")
    started = launch(shard("vllm"), "h", 9000, None, cores=((0, 1), (2, 3)))
    assert started.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    on_gpus = launch(shard("vllm"), "h", 9000, None)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in on_gpus.env


def test_the_pin_runs_the_command_on_its_cores_and_keeps_its_pid() -> None:
    core = max(os.sched_getaffinity(0))
    probe = "import os; print(os.getpid(), sorted(os.sched_getaffinity(0)))"
    proc = subprocess.Popen(
        pinned([sys.executable, "-c", probe], [core]), stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.strip().split(maxsplit=1) == [str(proc.pid), f"[{core}]"]


def test_the_pin_says_what_it_cannot_do() -> None:
    missing = subprocess.run(
        pinned(["no-such-engine-here"], [min(os.sched_getaffinity(0))]),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert missing.returncode == 127 and "cannot start no-such-engine-here" in missing.stderr
    nowhere = subprocess.run(
        pinned(["true"], [4095]), capture_output=True, text=True, timeout=30
    )  # a core this machine lacks
    assert nowhere.returncode == 1 and "cannot run on cores 4095" in nowhere.stderr
