"""What a reconcile pass decided, told: logged, and noted in the event log (retiring,
sleeping, waking and placed replicas, and pending ones when their count changes)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from modelfleet.controlplane.events import EventLog
from modelfleet.core.fleet import Replica
from modelfleet.core.reconcile import NewReplica, Pending, Plan

log = logging.getLogger("modelfleet.controlplane")


def tell_decided(events: EventLog, decided: Plan) -> None:
    """The replicas a plan retires, puts to sleep and wakes."""
    for stop in decided.stop:
        log.info("retiring replica %s: %s", stop.replica_id, stop.reason)
        if stop.drops_capacity:
            events.warning("CapacityDropped", f"replica/{stop.replica_id}", stop.reason)
        else:
            events.normal("ReplicaRetiring", f"replica/{stop.replica_id}", stop.reason)
    for sleep in decided.sleep:
        log.info("putting replica %s to sleep: %s", sleep.replica_id, sleep.reason)
        events.normal("ReplicaSleeping", f"replica/{sleep.replica_id}", sleep.reason)
    for wake in decided.wake:
        log.info("waking replica %s: %s", wake.replica_id, wake.reason)
        events.normal("ReplicaWaking", f"replica/{wake.replica_id}", wake.reason)


def tell_placed(events: EventLog, created: Sequence[Replica], new: Sequence[NewReplica]) -> None:
    """The replicas a plan placed, each where and why."""
    for replica, planned in zip(created, new, strict=True):
        where = ", ".join(f"{p.node}{list(p.gpus)}" for p in replica.shards)
        log.info("placed %s (%s) on %s", replica.id, replica.model, where)
        events.normal(
            "ReplicaPlaced",
            f"replica/{replica.id}",
            f"{replica.model} on {where}: {planned.reason}",
        )


def tell_pending(events: EventLog, before: Sequence[Pending], pending: Sequence[Pending]) -> None:
    """The models with replicas that cannot be placed now, when their count changed."""
    # Pending replicas are logged when their count changes, without the explanation: it
    # judges every node, and at 10,000 nodes going silent, working it out for each model at
    # each pass kept the control plane busy for minutes (even with the line not logged).
    was = {p.model: p.count for p in before}
    for p in pending:
        if was.get(p.model) != p.count:
            log.info(
                "%d replica(s) of %s pending; `modelfleet ctl explain %s` says why",
                p.count,
                p.model,
                p.model,
            )
            events.warning(
                "ReplicaPending",
                f"model/{p.model}",
                f"{p.count} replica(s) cannot be placed now: `ctl explain-placement "
                f"{p.model}` says why",
            )
