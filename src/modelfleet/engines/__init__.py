"""Engine drivers: how a shard assignment becomes an engine process.

A driver turns an assignment into a command line and environment, and says where the engine
answers its readiness probe. The agent's supervisor does the rest (start, probe, restart,
stop), the same for every engine.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Protocol

from modelfleet.wire import ShardAssignment


@dataclass(frozen=True)
class Launch:
    """What to execute for one shard."""

    argv: list[str]
    env: dict[str, str]


class NoDriver(LookupError):
    """The agent has no driver for an engine the catalog names."""


class EngineDriver(Protocol):
    """Turns a shard assignment into an engine process and a readiness probe."""

    name: str
    health_path: str

    def launch(self, shard: ShardAssignment, host: str, port: int, leader: str | None) -> Launch:
        """The command for `shard`, serving on host:port. `leader` is where the replica's
        shard 0 meets its peers ("host:port"), for a replica of several shards."""
        ...


def _gpu_env(shard: ShardAssignment) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in shard.gpus), **shard.env}


class SimDriver:
    """The engine simulator (`modelfleet engine-sim`), run with this agent's Python."""

    name = "sim"
    health_path = "/health"

    def launch(self, shard: ShardAssignment, host: str, port: int, leader: str | None) -> Launch:
        argv = [sys.executable, "-m", "modelfleet", "engine-sim", "--model", shard.model]
        argv += ["--host", host, "--port", str(port), *shard.args]
        return Launch(argv, _gpu_env(shard))


class CommandDriver:
    """An engine given as a command template in the catalog.

    The template may use {model}, {source}, {host}, {port}, {rank}, {num_shards}, {gpus}
    (comma-separated indices) and {leader} (shard 0's "host:port" for a replica of several
    shards, empty otherwise); the catalog's args are appended.
    """

    name = "command"
    health_path = "/health"

    def launch(self, shard: ShardAssignment, host: str, port: int, leader: str | None) -> Launch:
        template = shard.command or ""
        fields = {
            "model": shard.model,
            "source": shard.source,
            "host": host,
            "port": port,
            "rank": shard.rank,
            "num_shards": shard.num_shards,
            "gpus": ",".join(str(g) for g in shard.gpus),
            "leader": leader or "",
        }
        try:
            argv = [part.format(**fields) for part in shlex.split(template)]
        except (KeyError, IndexError, ValueError) as exc:
            raise NoDriver(f"command template {template!r} cannot be filled in: {exc}") from exc
        return Launch(argv + list(shard.args), _gpu_env(shard))


DRIVERS: dict[str, EngineDriver] = {d.name: d for d in (SimDriver(), CommandDriver())}


def driver_for(engine: str) -> EngineDriver:
    """The driver for `engine`; raises NoDriver when this agent has none."""
    try:
        return DRIVERS[engine]
    except KeyError:
        known = ", ".join(sorted(DRIVERS))
        raise NoDriver(
            f"this agent has no driver for engine {engine!r} (it has: {known})"
        ) from None
