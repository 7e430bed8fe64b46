"""The admin API's answers, built from the control plane's state when they are asked for."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.records import ReplicaRecord
from modelfleet.controlplane.state import FleetState
from modelfleet.core import residency
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.core.fleet import Mark, Replica
from modelfleet.core.placement import NodeVerdict, Placed, Unplaceable, describe_need, place
from modelfleet.core.reconcile import Preview
from modelfleet.messages import admin
from modelfleet.messages.wire import ShardReport, ShardState, engine_endpoint
from modelfleet.store import StoredCatalog


def verdict(v: NodeVerdict) -> admin.NodeVerdict:
    return admin.NodeVerdict(node=v.node, usable_gpus=list(v.usable_gpus), reasons=list(v.reasons))


def _spots(replica: Replica) -> list[admin.ShardSpot]:
    return [admin.ShardSpot(node=s.node, gpus=list(s.gpus)) for s in replica.shards]


def adapter_changes(
    state: FleetState,
    catalog: Catalog,
    demand: Mapping[str, Mapping[str, residency.Want]],
    busy: Mapping[str, float],
) -> list[admin.AdapterChange]:
    """What `catalog` makes each replica kept under it load and unload."""
    changes = []
    for rid, names in sorted(state.adapters.changes_for(catalog, demand, busy).items()):
        held = state.replicas[rid].adapters
        changes.append(
            admin.AdapterChange(
                replica=rid,
                load=[n for n in names if n not in held],
                unload=[n for n in held if n not in names],
            )
        )
    return changes


def steps(p: Preview) -> tuple[list[admin.Step], list[admin.PendingStep]]:
    """A preview's steps and what would stay pending, as the admin API answers them."""
    return (
        [
            admin.Step(
                step=s.step,
                action=s.action,
                id=s.replica.id,
                model=s.replica.model,
                shards=_spots(s.replica),
                reason=s.reason,
            )
            for s in p.steps
        ],
        [
            admin.PendingStep(model=x.model, count=x.count, reason=x.explanation.summary)
            for x in p.pending
        ],
    )


def nodes(state: FleetState, now: float, warning: str = "") -> admin.NodesAnswer:
    used = state.used_slots()
    on_node: dict[str, int] = {}
    for replica in state.planned():
        for node_name in {s.node for s in replica.shards}:
            on_node[node_name] = on_node.get(node_name, 0) + 1
    answer = []
    for node in state.node_list():
        gpus = [
            admin.GpuInfo(
                index=g.index,
                model=g.model,
                memory_total=g.memory_total,
                memory_free=g.memory_free,
                healthy=g.healthy,
                reason=g.reason,
                in_use=(node.name, g.index) in used,
            )
            for g in node.gpus
        ]
        grace_left = None
        if node.mark is Mark.DRAINING and node.drain_deadline is not None:
            grace_left = round(max(0.0, node.drain_deadline - now), 1)
        answer.append(
            admin.NodeInfo(
                name=node.name,
                ready=node.is_ready(now, state.stale_after),
                mark=node.mark.value,
                drain_grace_left_s=grace_left,
                address=node.address,
                labels=dict(node.labels),
                last_heard_s=round(now - (node.last_report or now), 1),
                reports=state.nodes[node.name].reports,
                heartbeats=state.nodes[node.name].beats,
                gpus=gpus,
                shards=len(state.nodes[node.name].report.shards),
                replicas=on_node.get(node.name, 0),
            )
        )
    return admin.NodesAnswer(nodes=answer, warning=warning)


def shard_views(state: FleetState, record: ReplicaRecord) -> list[admin.ShardInfo]:
    """Each shard of a replica as its node last reported it."""
    views = []
    for rank, placement in enumerate(record.replica.shards):
        seen = state.current(record, rank)
        views.append(
            admin.ShardInfo(
                rank=rank,
                node=placement.node,
                gpus=list(placement.gpus),
                state=seen.state.value if seen else "assigned",
                port=seen.port if seen else None,
                pid=seen.pid if seen else None,
                restarts=seen.restarts if seen else 0,
                failures=seen.failures if seen else 0,
                backoff_s=seen.backoff_s if seen else None,
                startup_s=seen.startup_s if seen else None,
                error=seen.error if seen else "",
                log_tail=list(seen.log_tail) if seen else [],
                engine_key_set=bool(seen and seen.engine_key),
                adapters=_adapter_views(record, seen) if rank == 0 else [],
            )
        )
    return views


def _adapter_views(record: ReplicaRecord, seen: ShardReport | None) -> list[admin.AdapterInfo]:
    """The adapters a replica should hold, with what its agent last said of each."""
    reported = {a.name: a for a in seen.adapters} if seen else {}
    views = []
    for name in sorted(set(record.adapters) | set(reported)):
        a = reported.get(name)
        if a is None:
            views.append(admin.AdapterInfo(name=name, state="wanted"))
        else:
            views.append(
                admin.AdapterInfo(name=name, state=a.state.value, tries=a.tries, error=a.error)
            )
    return views


def replica_state(
    state: FleetState, record: ReplicaRecord, ejected: Sequence[str] = ()
) -> admin.ReplicaState:
    """A replica's state worked out from its shards' (of its current generation): retiring,
    sleeping (told to, or asleep), ready (every shard; out-of-rotation when a router sends it
    nothing: `ejected` says why), failed (any failed, or started again after failing and not
    ready since: `FleetState.failure`), starting (any), or assigned (none reported yet)."""
    if record.retiring:
        return "retiring"
    if record.sleep:
        return "sleeping"
    states = set()
    for rank in range(len(record.replica.shards)):
        seen = state.current(record, rank)
        states.add(seen.state if seen is not None else None)
    if states == {ShardState.READY}:
        return "out-of-rotation" if ejected else "ready"
    if ShardState.FAILED in states or state.failure(record):
        return "failed"
    if ShardState.STARTING in states:
        return "starting"
    return "assigned"


def replica_view(
    state: FleetState, record: ReplicaRecord, ejected: Sequence[str] = ()
) -> admin.ReplicaInfo:
    """A replica as `ctl replicas show` shows it: its state worked out from its shards',
    and why routers took it out of rotation (`ejected`, from `LoadCollector.ejections`)."""
    shards = shard_views(state, record)
    shown = replica_state(state, record, ejected)
    endpoint = None
    if shown in ("ready", "out-of-rotation"):
        node = state.nodes[shards[0].node]
        seen = node.shard(record.replica.id, 0)
        if seen is not None and seen.port is not None:
            endpoint = engine_endpoint(node.report.address, seen.port, seen.tls)
    r = record.replica
    return admin.ReplicaInfo(
        id=r.id,
        model=r.model,
        state=shown,
        endpoint=endpoint,
        shards=shards,
        reason=record.retiring,
        generation=record.generation,
        group_restarts=record.group_restarts,
        last_failure=record.last_failure,
        ejected=list(ejected),
        error=state.failure(record) if shown == "failed" else "",
    )


def replica_views(
    state: FleetState, ejections: Mapping[str, Sequence[str]] | None = None
) -> list[admin.ReplicaInfo]:
    """Every replica, by model and id (`ejections`: replica id -> why routers send it no
    requests)."""
    records = sorted(state.replicas.values(), key=lambda r: (r.replica.model, r.replica.id))
    found = ejections or {}
    return [replica_view(state, r, found.get(r.replica.id, ())) for r in records]


def scaling(autoscaler: Autoscaler, catalog: Catalog) -> list[admin.ScaleInfo]:
    """The models of `catalog` that follow their load: count, bounds, and why."""
    counts = autoscaler.wanted(catalog)
    shown = []
    for spec in catalog.models:
        policy = spec.autoscale
        if policy is None:
            continue
        scale = autoscaler.scales.get(spec.name)
        load, now = autoscaler.lately.get(spec.name, (None, ""))
        shown.append(
            admin.ScaleInfo(
                model=spec.name,
                replicas=counts[spec.name],
                min=policy.min,
                max=policy.max,
                target_in_flight=policy.target_in_flight,
                reason=scale.reason if scale else "not decided yet: starts at min",
                since=scale.at if scale else None,
                load=load,
                now=now,
            )
        )
    return shown


def replicas(
    state: FleetState,
    catalog: Catalog,
    autoscaler: Autoscaler | None = None,
    ejections: Mapping[str, Sequence[str]] | None = None,
) -> admin.ReplicasAnswer:
    """Every replica and shard (log tails left out: a replica's own answer has them), and
    what is pending with every node's verdict."""
    listed = [
        view.model_copy(
            update={"shards": [s.model_copy(update={"log_tail": []}) for s in view.shards]}
        )
        for view in replica_views(state, ejections)
    ]
    pending = []
    for p in state.pending:
        spec = catalog.get(p.model)
        pending.append(
            admin.PendingInfo(
                model=p.model,
                count=p.count,
                reason=p.explanation.summary,
                needs=describe_need(spec) if spec else "",
                nodes=[verdict(v) for v in p.explanation.verdicts],
            )
        )
    scaled = [] if autoscaler is None else scaling(autoscaler, catalog)
    return admin.ReplicasAnswer(replicas=listed, pending=pending, scaling=scaled)


def explain(
    state: FleetState, catalog: Catalog, model: str, now: float
) -> Placed | Unplaceable | None:
    """Where the next replica of `model` would go, or why it could go nowhere; None when
    `catalog` has no such model."""
    spec = catalog.get(model)
    if spec is None:
        return None
    on_node: Counter[str] = Counter()
    for replica in state.planned():
        if replica.model == model:
            on_node.update(s.node for s in replica.shards)
    avoid = state.faults.avoiding(now).get(model, {})
    nodes, used = state.node_list(), state.used_slots()
    return place(spec, nodes, used, on_node, now, state.stale_after, avoid)


def explanation(
    state: FleetState, catalog: Catalog, model: str, now: float
) -> admin.Explanation | None:
    """Where `model`'s next replica would go, or why it cannot; None when it is not in
    `catalog`."""
    answer = explain(state, catalog, model, now)
    spec = catalog.get(model)
    if answer is None or spec is None:
        return None
    pending = state.pending_for(model)
    if isinstance(answer, Unplaceable):
        placeable, summary, placement = False, answer.summary, []
    else:
        placeable = True
        where = ", ".join(f"{s.node} gpus {list(s.gpus)}" for s in answer.shards)
        summary = f"the next replica would go to {where}"
        placement = [admin.ShardSpot(node=s.node, gpus=list(s.gpus)) for s in answer.shards]
    return admin.Explanation(
        model=model,
        needs=describe_need(spec),
        pending=pending.count if pending else 0,
        pending_reason=pending.explanation.summary if pending else "",
        placeable=placeable,
        summary=summary,
        placement=placement,
        nodes=[verdict(v) for v in answer.verdicts],
    )


def catalog(keeper: CatalogKeeper) -> admin.CatalogAnswer:
    current = keeper.current_info
    c = current.catalog
    rejected = keeper.last_rejection()
    return admin.CatalogAnswer(
        version=c.version,
        digest=c.digest,
        applied_at=current.applied_at,
        source=current.source,
        models=[admin.ModelInfo.model_validate(m.to_dict()) for m in c.models],
        last_rejection=(
            admin.Rejection(
                at=rejected.at, source=rejected.source, problems=list(rejected.problems)
            )
            if rejected
            else None
        ),
    )


def history(stored: list[StoredCatalog]) -> admin.CatalogHistory:
    return admin.CatalogHistory(
        versions=[
            admin.CatalogVersion(
                version=v.version,
                digest=v.digest,
                applied_at=v.applied_at,
                source=v.source,
                models=[m["name"] for m in v.body["models"]],
            )
            for v in stored
        ]
    )


def refused(exc: CatalogInvalid) -> admin.ErrorAnswer:
    """A refused catalog as the admin API answers it: every problem."""
    problems = [
        admin.CatalogProblem(model=p.model, field=p.field, message=p.message) for p in exc.problems
    ]
    message = f"the catalog is invalid ({len(problems)} problem(s)); nothing was changed"
    return admin.ErrorAnswer(error=message, problems=problems)
