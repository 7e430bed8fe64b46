"""A shard's last stage: every process of its engine's group stopped."""

from __future__ import annotations

import asyncio
import logging

from modelfleet.agent.adopt import EngineProcess
from modelfleet.host.processes import stop_groups, stop_leftovers

log = logging.getLogger("modelfleet.agent")


def _stop_group(leader: int, grace: float) -> list[int]:
    """SIGTERM to the engine's own server, which stops its workers its own way once what is in
    flight has finished; SIGKILL to all of its group still there after `grace`."""
    return stop_groups([leader], grace, leaders_only=True)


async def terminate(proc: EngineProcess, grace: float, key: str) -> None:
    """Stop every process of the engine's group (shard `key`'s), its leader exited or not:
    SIGTERM (to the leader while it runs), SIGKILL to the group after `grace` seconds; return
    once they are all gone (their GPU memory freed)."""
    # Once the leader has exited, its pid may be another process's by now (the kernel keeps it
    # while the group has members): the group is ours while no process holds it.
    stop = stop_leftovers if proc.poll() is not None else _stop_group
    killed = await asyncio.to_thread(stop, proc.pid, grace)
    if killed:
        log.warning(
            "shard %s: engine group %d did not end on SIGTERM within %.0fs; killed",
            key,
            proc.pid,
            grace,
        )
