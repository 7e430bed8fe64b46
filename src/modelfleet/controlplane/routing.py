"""The routing table the control plane publishes: every model of the catalog with the
endpoints of its serving replicas."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from modelfleet.controlplane.state import FleetState
from modelfleet.core.catalog import Catalog, ModelSpec
from modelfleet.messages.wire import AdapterState, RoutedModel, engine_endpoint


class RoutingTable:
    """The routing table of one `FleetState`. Each model's entry is kept until something its
    routing depends on changed (a replica of it added, dropped or retiring, a report of a node
    holding one, another catalog): what a change costs here is the changed models' share of
    the fleet, and a pass with nothing new costs a look per model."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        # model -> ((its stamp, the catalog's digest, its count) when built, its entry)
        self._kept: dict[str, tuple[tuple[int, str, int | None], RoutedModel]] = {}
        # model -> (its entry, why it cannot serve, the entry saying so): the same object
        # while neither changes (the publisher keeps each entry's JSON by the object)
        self._said: dict[str, tuple[RoutedModel, str, RoutedModel]] = {}

    def models(
        self, catalog: Catalog, wanted: Mapping[str, int] = MappingProxyType({})
    ) -> list[RoutedModel]:
        """Every model of `catalog` with the endpoints of its serving replicas, and the
        catalog's routing fields (`wanted`: the counts of the models that follow their load).

        Only models of that catalog are published, and never a retiring replica: a replica of a
        removed model is not routed to, whatever state it is in.
        """
        table = []
        for spec in catalog.models:
            count = wanted.get(spec.name)
            made_from = (self.state.changes.rerouted_at(spec.name), catalog.digest, count)
            kept = self._kept.get(spec.name)
            if kept is None or kept[0] != made_from:
                kept = (made_from, _entry(self.state, spec, count))
                self._kept[spec.name] = kept
            table.append(self._saying_why(spec.name, kept[1]))
        if len(self._kept) > len(table):
            named = {m.name for m in catalog.models}
            self._kept = {name: kept for name, kept in self._kept.items() if name in named}
        return table

    def _saying_why(self, model: str, entry: RoutedModel) -> RoutedModel:
        """`entry`, and with no endpoint, why none is coming (`cannot_serve`). Worked out
        at every publish for the models with no endpoint: what it reads (the last pass's
        pending replicas, shards' failures) moves on without a reroute."""
        why = "" if entry.endpoints else cannot_serve(self.state, model)
        if not why:
            self._said.pop(model, None)
            return entry
        said = self._said.get(model)
        if said is None or said[0] is not entry or said[1] != why:
            said = (entry, why, entry.model_copy(update={"cannot_serve": why}))
            self._said[model] = said
        return said[2]


def cannot_serve(state: FleetState, model: str) -> str:
    """Why no replica of `model` can serve, while none serves and none is on its way: those
    wanted that cannot be placed (and why), and those failing (with the last error). "" when
    one is on its way (starting after no failure, assigned, or asleep: it wakes; or one that
    cannot be placed while GPUs are being let go: it may fit once they are), or when none is
    wanted (a model at zero replicas starts one when asked)."""
    records = [state.replicas[rid] for rid in state.of_model(model)]
    records = [r for r in records if not r.retiring]
    if any(r.sleep for r in records):
        return ""
    failing = [why for r in records if (why := state.failure(r))]
    if len(failing) < len(records):
        return ""
    parts = []
    pending = state.pending_for(model)
    if pending is not None and _freeing(state):
        return ""
    if pending is not None:
        parts.append(f"{pending.count} replica(s) cannot be placed: {pending.explanation.summary}")
    if failing:
        parts.append(f"{len(failing)} replica(s) failing: {failing[0]}")
    return "; ".join(parts)[:4000]


def _entry(state: FleetState, spec: ModelSpec, count: int | None) -> RoutedModel:
    """`spec`'s model with its serving replicas: not retiring nor asleep, every shard
    reported ready;
    each read straight from its shard 0's report (building each replica's whole view, every
    shard's log tail, cost most of a publish at scale)."""
    endpoints: list[str] = []
    keys: dict[str, str] = {}
    ids: dict[str, str] = {}
    nodes: dict[str, str] = {}
    adapters: dict[str, list[str]] = {a.name: [] for a in spec.adapters}
    errors: dict[str, str] = {}
    for rid in state.of_model(spec.name):
        record = state.replicas[rid]
        if record.retiring or record.sleep:
            continue
        kept = set(record.adapters)  # one it is to let go is routed to no more
        shards = record.replica.shards
        for rank, placement in enumerate(shards):
            node = state.nodes.get(placement.node)
            if node is None or (rid, rank) not in node.ready:
                break
            if len(shards) > 1 and state.current(record, rank) is None:
                break  # a shard of an earlier generation, being stopped
        else:
            first = state.nodes[shards[0].node]
            seen = first.shard(rid, 0)
            if seen is None or seen.port is None:
                continue
            endpoint = engine_endpoint(first.report.address, seen.port, seen.tls)
            endpoints.append(endpoint)
            ids[endpoint] = rid
            if seen.tls:
                nodes[endpoint] = shards[0].node
            if seen.engine_key is not None:
                keys[endpoint] = seen.engine_key
            for held in seen.adapters:
                if held.state is AdapterState.LOADED and held.name in kept & adapters.keys():
                    adapters[held.name].append(endpoint)
                elif held.state is AdapterState.FAILED:
                    errors[held.name] = held.error
    return RoutedModel(
        name=spec.name,
        endpoints=sorted(endpoints),
        keys=keys,
        replicas=ids,
        nodes=nodes,
        routing=spec.routing,
        first_byte_timeout=spec.first_byte_timeout,
        max_tokens_cap=spec.max_tokens_cap,
        max_tokens_over_cap=spec.max_tokens_over_cap,
        target_in_flight=None if spec.autoscale is None else spec.autoscale.target_in_flight,
        replicas_wanted=count,
        cold_queue=spec.cold_queue,
        cold_timeout=spec.cold_timeout,
        adapters={name: sorted(where) for name, where in adapters.items()},
        adapter_errors={name: why for name, why in errors.items() if not adapters.get(name)},
    )


def _freeing(state: FleetState) -> bool:
    """Whether GPUs are being let go: a replica retiring (scaled down, drained, asleep and
    lent to another model), or an engine of none still holding its GPUs as it stops."""
    if any(r.retiring for r in state.replicas.values()):
        return True
    held = {slot for r in state.replicas.values() for slot in r.replica.gpu_slots()}
    return not state.busy_slots() <= held
