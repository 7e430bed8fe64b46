"""The control plane's Prometheus metrics, served at `GET /metrics` on its admin listener.

Two kinds: counts of what happens between scrapes (reports, heartbeats, pushes, reconcile
passes), kept as prometheus-client counters and histograms in a registry of the control
plane's own; and the fleet as it is when scraped (nodes, GPUs, replicas, pending), read
from the state by a collector, so that keeping them costs nothing between scrapes.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.keys import KeyBook
from modelfleet.controlplane.state import FleetState
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.controlplane.views import replica_state
from modelfleet.core.fleet import Mark
from modelfleet.host.clock import Clock

_PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_CONFIRM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NODE_STATES = ("ready", "stale", "lost")
REPLICA_STATES = ("serving", "starting", "failed", "assigned", "retiring", "sleeping")


class Published(Protocol):
    """What the metrics read of the publisher (which counts its pushes here)."""

    @property
    def version(self) -> int: ...
    @property
    def epoch(self) -> int: ...


class Observed(Protocol):
    """What the metrics read of the control plane at each scrape (`plane.ControlPlane`,
    which holds them: named here by what they are, so that this module needs not the
    control plane's)."""

    @property
    def state(self) -> FleetState: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def config(self) -> ControlPlaneConfig: ...
    @property
    def catalogs(self) -> CatalogKeeper: ...
    @property
    def autoscaler(self) -> Autoscaler: ...
    @property
    def usage(self) -> UsageCollector: ...
    @property
    def publisher(self) -> Published: ...
    @property
    def keys(self) -> KeyBook: ...
    @property
    def passes(self) -> int: ...
    @property
    def plans(self) -> int: ...
    def settling(self, now: float) -> bool: ...


class ControlPlaneMetrics:
    """Every metric of one control plane, in a registry of its own (tests make many)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.reports = Counter(
            "modelfleet_controlplane_reports", "Agents' whole reports taken.", registry=r
        )
        self.heartbeats = Counter(
            "modelfleet_controlplane_heartbeats", "Agents' heartbeats taken.", registry=r
        )
        self.refused = Counter(
            "modelfleet_controlplane_agent_requests_refused",
            "Reports and heartbeats refused, by why: credential (401), impersonation (403), "
            "address (403: a joined node advertising an address it did not join from).",
            ["why"],
            registry=r,
        )
        self.throttled = Counter(
            "modelfleet_controlplane_throttled",
            "Tries refused unheard at a door that takes a secret from anyone (join, dashboard "
            "sign-in) while their address waits after failing again and again, by door.",
            ["door"],
            registry=r,
        )
        self.pass_seconds = Histogram(
            "modelfleet_controlplane_reconcile_pass_seconds",
            "How long a reconcile pass took; planned: whether it planned (the others had "
            "nothing new to plan from).",
            ["planned"],
            buckets=_PASS_BUCKETS,
            registry=r,
        )
        self.pushes = Counter(
            "modelfleet_controlplane_pushes",
            "Routing tables pushed to routers, by router and result (confirmed, refused, "
            "unreachable).",
            ["router", "result"],
            registry=r,
        )
        self.confirm_seconds = Histogram(
            "modelfleet_controlplane_push_confirm_seconds",
            "From a routing table's publication until a router confirmed holding it.",
            ["router"],
            buckets=_CONFIRM_BUCKETS,
            registry=r,
        )

    def watch(self, cp: Observed) -> None:
        """Read `cp`'s state at every scrape."""
        self.registry.register(_FleetCollector(cp))


class _FleetCollector(Collector):
    """The fleet as the control plane knows it at the time of the scrape."""

    def __init__(self, cp: Observed) -> None:
        self.cp = cp

    def collect(self) -> Iterator[Metric]:
        cp, state = self.cp, self.cp.state
        now = cp.clock.monotonic()
        timing = cp.config.heartbeats(len(state.nodes))

        nodes = GaugeMetricFamily(
            "modelfleet_controlplane_nodes",
            "Nodes by state: ready (heard from within node_stale_after), stale, lost (silent "
            "past node_lost_after).",
            labels=["state"],
        )
        marked = GaugeMetricFamily(
            "modelfleet_controlplane_nodes_marked",
            "Nodes by an operator's mark: cordoned, draining, revoked.",
            labels=["mark"],
        )
        gpus = GaugeMetricFamily(
            "modelfleet_controlplane_gpus", "GPUs of the nodes, by health.", labels=["health"]
        )
        by_state: Tally[str] = Tally()
        by_mark: Tally[str] = Tally()
        by_health: Tally[str] = Tally()
        for node in state.nodes.values():
            silent = now - node.received
            if silent <= timing.stale_after:
                by_state["ready"] += 1
            elif silent > timing.lost_after:
                by_state["lost"] += 1
            else:
                by_state["stale"] += 1
            if node.mark.mark is not Mark.NONE:
                by_mark[node.mark.mark.value] += 1
            for gpu in node.report.gpus:
                by_health["healthy" if gpu.healthy else "unhealthy"] += 1
        for name in NODE_STATES:
            nodes.add_metric([name], by_state[name])
        for mark in (Mark.CORDONED, Mark.DRAINING, Mark.REVOKED):
            marked.add_metric([mark.value], by_mark[mark.value])
        for health in ("healthy", "unhealthy"):
            gpus.add_metric([health], by_health[health])
        yield from (nodes, marked, gpus)

        catalog = cp.catalogs.current
        replicas = GaugeMetricFamily(
            "modelfleet_controlplane_replicas",
            "Replicas in the table, by model and state: serving (every shard ready), "
            "starting, failed, assigned (not yet reported), retiring.",
            labels=["model", "state"],
        )
        counts: Tally[tuple[str, str]] = Tally()
        for replica in state.replicas.values():
            shown = replica_state(state, replica)
            counts[(replica.replica.model, "serving" if shown == "ready" else shown)] += 1
        models = {m.name for m in catalog.models} | {model for model, _ in counts}
        for model in sorted(models):
            for name in REPLICA_STATES:
                replicas.add_metric([model, name], counts[(model, name)])
        yield replicas

        desired = GaugeMetricFamily(
            "modelfleet_controlplane_replicas_desired",
            "Replicas wanted, by model: the catalog's count, or the autoscaler's for a model "
            "that follows its load.",
            labels=["model"],
        )
        scaled = cp.autoscaler.wanted(catalog)
        for spec in catalog.models:
            desired.add_metric([spec.name], scaled.get(spec.name, spec.replicas))
        yield desired
        load = GaugeMetricFamily(
            "modelfleet_controlplane_model_load",
            "Requests a model that follows its load carries, as the autoscaler last read it "
            "from the routers (in flight, waiting and held).",
            labels=["model"],
        )
        for model, (n, _) in sorted(cp.autoscaler.lately.items()):
            load.add_metric([model], n)
        yield load

        pending = GaugeMetricFamily(
            "modelfleet_controlplane_replicas_pending",
            "Replicas that cannot be placed now, by model and why (`ctl explain-placement "
            "MODEL` gives every node's verdict).",
            labels=["model", "reason"],
        )
        for p in state.pending:
            pending.add_metric([p.model, p.explanation.summary.split(":")[0]], p.count)
        yield pending

        for name, doc, value in (
            ("reconcile_passes", "Reconcile passes made (after settling).", cp.passes),
            ("reconcile_plans", "Passes that planned: the others had nothing new.", cp.plans),
            ("usage_batches", "Batches of usage counts collected from routers and stored.",
             cp.usage.stored),
        ):  # fmt: skip
            yield CounterMetricFamily(f"modelfleet_controlplane_{name}", doc, value=value)
        for name, doc, value in (
            ("catalog_version", "The version of the catalog applied.", catalog.version),
            ("routing_version", "The version of the routing table published.",
             cp.publisher.version),
            ("routing_epoch", "One more at every start of the control plane.",
             cp.publisher.epoch),
            ("api_keys", "Client API keys managed.", len(cp.keys.keys)),
            ("settling", "1 while the settling window after a start is open.",
             int(cp.settling(now))),
        ):  # fmt: skip
            yield GaugeMetricFamily(f"modelfleet_controlplane_{name}", doc, value=value)
