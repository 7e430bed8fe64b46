"""Engine drivers: how a shard assignment becomes an engine process.

A driver turns an assignment into a command line, an environment and a readiness probe
(`Launch`). The agent's supervisor does the rest (start, probe, restart, stop), the same for
every engine. One module per engine.

May import: the messages and the pure core; the agent alone uses it (and the command line,
to name the engines it knows).
"""

from __future__ import annotations

from modelfleet.engines.base import EngineDriver, Launch, NoDriver
from modelfleet.engines.command import CommandDriver
from modelfleet.engines.llamacpp import LlamaCppDriver
from modelfleet.engines.sglang import SglangDriver
from modelfleet.engines.sim import SimDriver
from modelfleet.engines.vllm import VllmDriver

__all__ = ["DRIVERS", "EngineDriver", "Launch", "NoDriver", "driver_for"]

DRIVERS: dict[str, EngineDriver] = {
    d.name: d
    for d in (VllmDriver(), SglangDriver(), LlamaCppDriver(), SimDriver(), CommandDriver())
}


def driver_for(engine: str) -> EngineDriver:
    """The driver for `engine`; raises NoDriver when this agent has none."""
    try:
        return DRIVERS[engine]
    except KeyError:
        known = ", ".join(sorted(DRIVERS))
        raise NoDriver(
            f"this agent has no driver for engine {engine!r} (it has: {known})"
        ) from None
