"""Simulated GPUs look as vLLM makes real ones look (issue 41: the simulator reported no
memory or utilisation at all): 90 % of a GPU's memory held while its engine runs and is
awake, and busy for the share of time its engine had a request running."""

from __future__ import annotations

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.agent.use import (
    SIM_MEMORY_SHARE,
    EngineOn,
    SimulatedUse,
    held_memory,
    read_busy_seconds,
)
from modelfleet.messages.wire import ShardState

GIB = 2**30
TOTALS = {0: 80 * GIB, 1: 80 * GIB, 2: 40 * GIB}


def test_memory_is_held_while_an_engine_runs_awake() -> None:
    held = int(80 * GIB * SIM_MEMORY_SHARE)
    engines = [((0, 1), ShardState.READY), ((2,), ShardState.SLEEPING)]
    assert held_memory(engines, TOTALS) == {0: held, 1: held, 2: 0}
    for state, holds in ((ShardState.STARTING, True), (ShardState.STOPPING, True),
                         (ShardState.FAILED, False)):  # fmt: skip
        assert (held_memory([((0,), state)], TOTALS)[0] > 0) is holds, state
    two = held_memory([((0,), ShardState.READY), ((0,), ShardState.STOPPING)], TOTALS)
    assert two[0] == 80 * GIB  # two engines on one GPU: never more than it has
    gpus = SimulatedGpus("2x80GB")
    gpus.holding = lambda: [((1,), ShardState.READY)]
    assert [g.memory_used for g in gpus.gpus()] == [0, int(80e9 * SIM_MEMORY_SHARE)]


def test_utilisation_is_the_engines_busy_share_between_samples() -> None:
    use = SimulatedUse()
    first = use.sample([EngineOn("a/0", (0, 1), busy_seconds=10.0)], TOTALS, now=100.0)
    assert first == {0: 0.0, 1: 0.0, 2: 0.0}  # nothing to compare with yet
    second = use.sample([EngineOn("a/0", (0, 1), busy_seconds=11.5)], TOTALS, now=102.0)
    assert second == {0: 75.0, 1: 75.0, 2: 0.0}  # 1.5 s busy of 2 s
    silent = use.sample([EngineOn("a/0", (0, 1), busy_seconds=None)], TOTALS, now=104.0)
    assert silent == {0: 0.0, 1: 0.0, 2: 0.0}
    # A restarted engine counts from zero again: never a negative share, never over 100 %.
    use.sample([EngineOn("a/0", (0,), busy_seconds=5.0)], TOTALS, now=105.0)
    assert use.sample([EngineOn("a/0", (0,), busy_seconds=0.5)], TOTALS, now=106.0)[0] == 0.0
    assert use.sample([EngineOn("a/0", (0,), busy_seconds=9.0)], TOTALS, now=107.0)[0] == 100.0


def test_the_busy_seconds_are_read_from_the_simulators_page() -> None:
    page = """# TYPE sim:busy_seconds counter
sim:busy_seconds_total{model_name="m"} 12.5
sim:busy_seconds_created{model_name="m"} 1.7e9
"""
    assert read_busy_seconds(page) == 12.5
    assert read_busy_seconds("# TYPE vllm:num_requests_running gauge\n") is None
