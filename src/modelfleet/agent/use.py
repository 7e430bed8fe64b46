"""What simulated GPUs hold and how busy they are, worked out from the engines on them.

A real GPU says it itself, through NVML. A simulated one looks as vLLM on a real one would
make it look: each engine on it that is starting, serving or stopping (and not asleep)
holds SIM_MEMORY_SHARE of its memory, as vLLM takes 90 % of a GPU's memory
(`gpu_memory_utilization`) as it starts and gives it back when it exits or sleeps (worked
out from the shards' states whenever the GPUs are read, so a report that says an engine
started says its memory too); and it is busy for the share of time its engine had a
request running, which the simulator counts (`sim:busy_seconds`) as NVML counts the share
of time a kernel ran, sampled every USE_EVERY_S.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from modelfleet.messages.wire import ShardState

SIM_MEMORY_SHARE = 0.9
USE_EVERY_S = 2.0
BUSY_METRIC = "sim:busy_seconds"
HOLDING = frozenset({ShardState.STARTING, ShardState.READY, ShardState.STOPPING})


@dataclass(frozen=True)
class EngineOn:
    """One engine of this node, as sampled for its GPUs' utilisation."""

    key: str  # its shard's key
    gpus: tuple[int, ...]
    busy_seconds: float | None  # as its engine said just now; None: it did not say


def read_busy_seconds(page: str) -> float | None:
    """The simulator's busy seconds on its metrics page; None when the page has none."""
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == f"{BUSY_METRIC}_total":
                return float(sample.value)
    return None


def held_memory(
    holding: Iterable[tuple[Sequence[int], ShardState]], totals: Mapping[int, int]
) -> dict[int, int]:
    """GPU index -> the memory its engines hold, for every GPU in `totals` (index -> its
    memory), given each engine's GPUs and state now."""
    held = dict.fromkeys(totals, 0)
    for gpus, state in holding:
        if state in HOLDING:
            for index in gpus:
                if index in totals:
                    held[index] = min(
                        totals[index], held[index] + int(totals[index] * SIM_MEMORY_SHARE)
                    )
    return held


class SimulatedUse:
    """Each simulated GPU's utilisation, from samples of its engines' busy seconds."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}  # shard key -> (when, busy seconds)

    def sample(
        self, engines: Iterable[EngineOn], gpus: Iterable[int], now: float
    ) -> dict[int, float]:
        """GPU index -> utilisation in %, for each of `gpus`, given the engines on them now
        (`now`: a monotonic clock): the busiest engine's share since its last sample."""
        busy = dict.fromkeys(gpus, 0.0)
        seen = set()
        for engine in engines:
            if engine.busy_seconds is None:
                continue
            seen.add(engine.key)
            before = self._last.get(engine.key)
            self._last[engine.key] = (now, engine.busy_seconds)
            if before is None or now <= before[0]:
                continue
            share = min(1.0, max(0.0, engine.busy_seconds - before[1]) / (now - before[0]))
            for index in engine.gpus:
                if index in busy:
                    busy[index] = max(busy[index], 100.0 * share)
        self._last = {k: v for k, v in self._last.items() if k in seen}
        return busy
