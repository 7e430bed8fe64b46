"""The events an agent's report makes news of, against the node's report before it: a node's
first report, a new agent run, its shards' changes of state (started, ready, failed, restarted,
asleep, awake, adopted), its GPUs' changes of health. Pure: the control plane records them
(`FleetState.tell`, then the event log)."""

from __future__ import annotations

from collections.abc import Iterator

from modelfleet.messages.wire import AgentReport, ShardState

# (type, reason, regarding, message), as the event log takes them.
News = tuple[str, str, str, str]


# The news of a term taking a running fleet over (after a restart or a failover): while it
# settles, these are not told one by one but once, settled (`taken_over`). Told one by one,
# 10,000 nodes coming back to a restarted control plane made 30,000 events that say nothing
# happened: each restart pushed a third of the kept history out, and writing them took CPU
# the agents waiting to be taken needed.
TAKING_OVER = frozenset({"NodeReported", "ShardAdopted"})


def taken_over(
    nodes: int, waited: int, missing: int, replicas: int, shards: int, took_s: float
) -> News:
    """The one event saying what a term took over, once it has settled: `missing` of the
    `waited` nodes had not reported by then (what runs on them is taken over, and told, as
    they do)."""
    late = (
        f"; {missing} of the {waited} waited for not yet: what runs there is taken over as "
        "they report"
        if missing
        else f" ({waited} waited for)"
    )
    return (
        "normal",
        "FleetTakenOver",
        "fleet/all",
        f"settled after {took_s:.1f}s: {nodes} node(s) reported{late}; {replicas} replica(s) "
        f"found serving on them taken over as they run ({shards} shard(s))",
    )


def report_news(node: str, old: AgentReport | None, new: AgentReport) -> Iterator[News]:
    """The events of a report: a node's first, its shards' changes of state, its GPUs'
    changes of health."""
    if old is None:
        gpus = len(new.gpus)
        yield ("normal", "NodeReported", f"node/{node}", f"{gpus} GPU(s) at {new.address}")
    elif old.boot_id != new.boot_id:
        held = len(new.shards)
        yield ("normal", "AgentRestarted", f"node/{node}", f"a new agent run, {held} shard(s) held")
    was = {(s.replica_id, s.rank): s for s in old.shards} if old is not None else {}
    for s in new.shards:
        before = was.get((s.replica_id, s.rank))
        where = f"shard {s.rank} on {node}"
        if before is not None and s.restarts > before.restarts:
            # Said even when the failure came and went between two reports (a kill -9 of
            # a serving engine, restarted at once): no report showed it failed.
            why = f": {s.last_failure}" if s.last_failure else ""
            if ShardState.FAILED not in (before.state, s.state):
                failed = s.last_failure or "its engine exited"
                yield ("warning", "ShardFailed", f"replica/{s.replica_id}", f"{where}: {failed}")
            yield (
                "warning",
                "ShardRestarted",
                f"replica/{s.replica_id}",
                f"{where} started again by its agent ({s.restarts} restart(s)){why}",
            )
        if before is not None and (before.state, before.generation) == (s.state, s.generation):
            continue
        if s.state is ShardState.STARTING:
            pid = f" (pid {s.pid})" if s.pid is not None else ""
            yield ("normal", "ShardStarted", f"replica/{s.replica_id}", f"{where}{pid}")
        elif s.state is ShardState.SLEEPING:
            yield ("normal", "ShardAsleep", f"replica/{s.replica_id}", f"{where} asleep")
        elif (
            s.state is ShardState.READY
            and before is not None
            and (before.state is ShardState.SLEEPING)
        ):
            yield ("normal", "ShardAwake", f"replica/{s.replica_id}", f"{where} awake")
        elif s.state is ShardState.READY and old is None:
            # The first this control plane heard of the node (it started, or took over),
            # and the engine already serves: taken over as it runs, not started.
            pid = f" (pid {s.pid})" if s.pid is not None else ""
            yield ("normal", "ShardAdopted", f"replica/{s.replica_id}", f"{where} serving{pid}")
        elif s.state is ShardState.READY:
            took = f" in {s.startup_s:.1f}s" if s.startup_s is not None else ""
            yield ("normal", "ShardReady", f"replica/{s.replica_id}", f"{where} ready{took}")
        elif s.state is ShardState.FAILED:
            yield ("warning", "ShardFailed", f"replica/{s.replica_id}", f"{where}: {s.error}")
    health = {g.index: g for g in old.gpus} if old is not None else {}
    for g in new.gpus:
        known = health.get(g.index)
        if known is not None and known.healthy == g.healthy:
            continue
        if not g.healthy:
            yield ("warning", "GpuUnhealthy", f"node/{node}", f"gpu {g.index}: {g.reason}")
        elif known is not None:
            yield ("normal", "GpuHealthy", f"node/{node}", f"gpu {g.index} healthy again")
