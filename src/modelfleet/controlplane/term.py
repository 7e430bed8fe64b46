"""`Term`: what a control plane learns and decides while it leads, from election to loss.

A term begins when this control plane takes the lease, or takes it again after its acting
lapsed (it was frozen, or cut off from its store, past what its lease let it do): either way
it knows nothing of the fleet yet. It reads what is desired from the store, settles while the
agents find it, adopts what runs, and publishes no routing table until the nodes it waits for
have reported. Everything it learns (nodes, replicas, last-heard times, plans, the autoscaler's
trends) belongs to the term and is dropped with it: a control plane that leads again starts
from nothing, as a new leader does, and cannot act on what it saw before.

A pass (`reconcile_once`) plans only when something it plans from changed since the last one
that did, or a time it plans by came (a node goes silent, a drain's grace ends), or
`reconcile_full_interval` has passed: an idle pass at any fleet size costs next to nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from modelfleet.controlplane.assignments import Assignments
from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.config import DEFAULT_SETTLE_FOR_S, ControlPlaneConfig, Heartbeats
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.loads import LoadCollector
from modelfleet.controlplane.node_news import NodeNews
from modelfleet.controlplane.plan_news import tell_decided, tell_pending, tell_placed
from modelfleet.controlplane.publisher import Publisher
from modelfleet.controlplane.report_news import taken_over
from modelfleet.controlplane.routing import RoutingTable
from modelfleet.controlplane.state import FleetState
from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Mark
from modelfleet.core.reconcile import Move, Preview, plan, preview, rebalance, settling
from modelfleet.core.residency import Want
from modelfleet.messages.wire import RoutedKey

log = logging.getLogger("modelfleet.controlplane")

# A replica's adapter swap waits for every router to stop sending it requests for what it lets
# go; a router that does not confirm holds it up no longer than this.
ADAPTER_SWAP_GRACE_S = 5.0


class Term:
    """One term of this control plane: the fleet as it learned it, and its passes.

    `roster`: the nodes that held replicas when the store last said (the term before kept
    it there); None when the store has never said. `epoch` is the lease's.
    """

    def __init__(
        self,
        epoch: int | None,
        began: float,
        config: ControlPlaneConfig,
        events: EventLog,
        publisher: Publisher,
        loads: LoadCollector,
        autoscaler: Autoscaler,
        monotonic: Callable[[], float],
        roster: frozenset[str] | None = None,
        took_over: bool = False,
    ) -> None:
        self.epoch = epoch
        self.config = config
        self.events = events
        self.publisher = publisher
        self.loads = loads
        self.autoscaler = autoscaler
        self.monotonic = monotonic
        self.state = FleetState(stale_after=config.node_stale_after)
        self.assignments = Assignments(self.state)
        self.routing = RoutingTable(self.state)
        self.started_at = began
        self.settle_for = config.settle_for or DEFAULT_SETTLE_FOR_S
        self.roster = roster
        # The nodes settling waits for, once per term: built on every check, it was most of
        # a restart's CPU (a pass for each of 10,000 reports coming back, each checking it).
        self._waited = frozenset(config.known_nodes) | (roster or frozenset())
        self.took_over = took_over  # another led before: no table until a node reported
        self._settled = False
        if epoch is not None and self.settle_for >= 0 and (roster or took_over):
            # A running fleet to take over (not a first start), in a settling window.
            self.state.taking_over = True
        self.node_news = NodeNews(self.state, config, events)  # silences, drains, forgetting
        self.passes = 0  # reconcile passes made (after settling), for operators and tests
        self.plans = 0  # those of them that planned: the others had nothing new to plan from
        # What the last pass that planned planned from (the table's change count, the
        # catalog's digest), when it ran, and the next time a pass must plan with nothing new.
        self._planned: tuple[int, str] | None = None
        self.planned_at = 0.0
        self._due = 0.0
        # What the last pass that planned the whole fleet planned from: when only the routing
        # stamps of some models moved on since, the next plans those models only.
        self._planned_whole: tuple[int, str, int] | None = None  # membership, catalog, stamp
        self._planned_stamp = 0
        self._whole_at = 0.0
        self.planned_models: int | None = None  # how many models the last plan planned
        self.frozen = ""  # the last pass's `Plan.frozen`: why nothing moves off lost nodes
        self._cold_refused: set[str] = set()  # models `cold_start` could not start (said)
        self.retime()

    # -- settling --------------------------------------------------------------------------

    def settling(self, now: float) -> bool:
        """Whether the term still settles (`reconcile.settling`): it adopts what agents
        report, and neither places nor tears down nor publishes. It waits for the nodes of
        the roster the store kept and the `known_nodes`, for `settle_for` past the last node
        new to it, `node_lost_after` at most. Once ended it stays ended (and this costs
        nothing more).

        A term that waits for nodes by name waits for the first report, however long: its
        window (and its bound) begin with it. A new leader whose agents had not found it
        yet (still trying control planes whose view was stale) once settled by its bound with
        no node, then placed anew on the first that reported and retired the extra replica
        in the same second, once the node holding it reported too."""
        if self._settled:
            return False
        reported = len(self.state.nodes)
        waited = self._waited
        if waited and not reported and self.settle_for >= 0:
            return True
        began = max(self.started_at, self.state.first_node_at) if waited else self.started_at
        everyone: bool | None = None
        if waited or self.roster is not None:
            # The names are compared only once as many have reported as are waited for: on
            # every report of 10,000 nodes coming back, comparing them was most of a restart's
            # cost.
            everyone = reported >= len(waited) and waited <= self.state.nodes.keys()
        bound = max(self.settle_for, self.config.node_lost_after)
        self._settled = not settling(
            now, began, self.settle_for, bound, max(began, self.state.newest_node_at), everyone
        )
        if not self._settled:
            return True
        if self.epoch is not None:  # (a follower's term only waits)
            log.info(
                "settled after %.1fs: %d node(s) reported, %d waited for",
                now - self.started_at,
                reported,
                len(waited),
            )
        if self.state.taking_over:
            self.state.taking_over = False
            adopted = [r.replica for r in self.state.replicas.values() if r.adopted]
            shards = sum(len(r.shards) for r in adopted)
            took = now - self.started_at
            missing = len(waited - self.state.nodes.keys())
            told = taken_over(reported, len(waited), missing, len(adopted), shards, took)
            self.state.tell(*told)
        return False

    # -- passes ----------------------------------------------------------------------------

    def retime(self) -> Heartbeats:
        """The heartbeat interval and silences for the fleet's size now (the state's stale
        time follows them)."""
        timing = self.config.heartbeats(len(self.state.nodes))
        self.state.stale_after = timing.stale_after
        return timing

    def replan(self) -> None:
        """Make the next pass plan, the whole fleet, even when nothing it plans from changed."""
        self._planned = None
        self._planned_whole = None

    def plan_inputs(self, catalog: Catalog, now: float) -> dict[str, Any]:
        """What a plan of `catalog` is made from, besides the table and the catalog: the one
        set of inputs a pass plans with and a preview (`ctl catalog apply`) starts from, so
        that what is shown is what is done."""
        s = self.state
        return {
            "nodes": s.node_list(),
            "busy": s.busy_slots(),
            "now": now,
            "stale_after": s.stale_after,
            "avoid": s.faults.avoiding(now),
            "lost_after": self.config.heartbeats(len(s.nodes)).lost_after,
            "moving": s.moving,
            "wanted": self.autoscaler.wanted(catalog),
            "load": self.replica_loads(),
            "asleep": s.asleep(),
        }

    def reconcile_once(self, catalog: Catalog, now: float) -> None:
        """One pass: plan against what is known, carry the plan out (unless settling, or
        nothing it plans from changed since the last pass that planned)."""
        if self.settling(now):
            return
        self.passes += 1
        s = self.state
        timing = self.retime()
        planned_from = (s.changes.version, catalog.digest)
        safety_net = now - self._whole_at >= self.config.reconcile_full_interval
        if now >= self._due:
            # Nodes heard from since the due time was worked out moved it on.
            self._due = self._next_due(self.planned_at, timing)
        due = now >= self._due
        if planned_from == self._planned and not safety_net and not due:
            return
        self.plans += 1
        # Only some models changed (their replicas, or reports of nodes holding them), and
        # nothing that concerns every model (another catalog, a node come or gone, a time come):
        # those are planned, with the ones left pending (what changed may make room for them).
        whole = (s.changes.membership, catalog.digest, s.changes.stamp)
        models: set[str] | None = None
        if (
            self._planned_whole is not None
            and self._planned_whole[:2] == whole[:2]
            and not safety_net
            and not due
        ):
            models = {
                m.name
                for m in catalog.models
                if s.changes.rerouted_at(m.name) > self._planned_stamp
            }
            models |= {p.model for p in s.pending}
        self.planned_models = len(catalog.models) if models is None else len(models)
        if models is None:
            self._whole_at = now
        self.node_news.forget_silent(now)
        self.node_news.note_silences(now, timing)
        self.node_news.note_drains()
        # Taken before the plan is carried out: what it changes is planned from once more, so
        # anything a pass leaves for the next (a replacement held back) is not left waiting.
        self._planned, self.planned_at = (s.changes.version, catalog.digest), now
        self._planned_whole, self._planned_stamp = whole, s.changes.stamp
        self.restart_groups()
        failed = {}
        for rid, (node, why) in s.faults.failing(self.config.max_failures).items():
            model = s.replicas[rid].replica.model
            s.faults.keep_off(model, node, why, now + self.config.failure_avoid)
            failed[rid] = why
            self.events.warning("ModelKeptOff", f"node/{node}", f"{model} kept off: {why}")
        decided = plan(
            catalog,
            s.planned(),
            s.serving(),
            failed=failed,
            models=models,
            **self.plan_inputs(catalog, now),
        )
        if decided.frozen != self.frozen:
            if decided.frozen:
                log.warning("%s", decided.frozen)
                self.events.warning("FleetFrozen", "fleet/all", decided.frozen)
            else:
                log.info("nodes report again: lost nodes are handled as usual")
                self.events.normal("FleetThawed", "fleet/all", "nodes report again")
            self.frozen = decided.frozen
        tell_decided(self.events, decided)
        before = s.pending
        if models is not None:  # the models not planned keep what they had pending
            kept = tuple(p for p in before if p.model not in models)
            decided = dataclasses.replace(decided, pending=kept + decided.pending)
        created = s.apply(decided, catalog, now, self.config.retire_timeout)
        tell_placed(self.events, created, decided.new)
        tell_pending(self.events, before, decided.pending)
        self._due = self._next_due(now, timing)

    def preview_work(
        self, catalog: Catalog, now: float, marks: Mapping[str, Mark] | None = None
    ) -> Callable[[], Preview]:
        """What the next passes would start and stop to make `catalog` true, as work to run
        in a worker thread: it plans up to hundreds of passes, on a copy of what it reads (the
        table and the nodes are immutable values), the first from exactly what the next pass
        plans from. `marks`: those nodes as if they had these marks (a drain without a bound,
        so that what could not be replaced shows as pending, not as stopped)."""
        s = self.state
        failing = {rid: why for rid, (_, why) in s.faults.failing(self.config.max_failures).items()}
        table, serving = s.planned(), frozenset(r.id for r in s.planned() if s.is_serving(r.id))
        inputs = self.plan_inputs(catalog, now)
        if marks:
            inputs["nodes"] = [
                dataclasses.replace(n, mark=marks[n.name], drain_deadline=None)
                if n.name in marks
                else n
                for n in inputs["nodes"]
            ]

        def work() -> Preview:
            done = preview(catalog, table, serving=serving, failed=failing, **inputs)
            for pending in done.pending:
                _ = pending.explanation  # worked out here, not when the answer is built
            return done

        return work

    def rebalance(self, catalog: Catalog, model: str | None, dry_run: bool) -> tuple[Move, ...]:
        """The moves that even out spread models over the nodes that can host them (one
        model, or all); unless `dry_run`, each moving replica is replaced elsewhere,
        make-before-break and `max_parallel` at a time, as in a drain."""
        s = self.state
        moves = rebalance(
            catalog,
            s.planned(),
            s.node_list(),
            s.busy_slots(),
            self.monotonic(),
            s.stale_after,
            None if model is None else {model},
        )
        if not dry_run:
            for move in moves:
                s.move(move.replica_id, move.reason)
                log.info(
                    "moving replica %s off %s: %s", move.replica_id, move.from_node, move.reason
                )
        return moves

    def restart_groups(self) -> None:
        """Restart together every shard of each replica of several shards one shard of which
        failed (as LeaderWorkerSet recreates a group): it left the routers' table with the
        report that said so. After `max_failures` restarts in a row that never served, it is
        left to `failing`: placed anew elsewhere, its model kept off the node."""
        s = self.state
        for rid, why in s.faults.broken_groups().items():
            record = s.replicas[rid]
            if record.group_restarts >= self.config.max_failures:
                continue
            count = s.faults.restart_group(rid, why)
            log.warning(
                "replica %s: %s; restarting its %d shards together, rank 0 first (%d in a row)",
                rid,
                why,
                len(record.replica.shards),
                count,
            )
            self.events.warning(
                "ShardsRestarted",
                f"replica/{rid}",
                f"{why}; all shards restarted ({count} in a row)",
            )

    def _next_due(self, since: float, timing: Heartbeats) -> float:
        """The time from `since` on at which a pass must plan though nothing new came: a node
        goes stale, lost or forgettable, a drain's grace ends, a model may go back on a node.

        Those that come within one reconcile interval of the first are planned for together:
        10,000 nodes going silent cross their thresholds one by one, and a whole plan for each
        kept the control plane planning back to back.
        """
        spans = (timing.stale_after, timing.lost_after, self.config.node_forget_after)
        times = [self.state.heard.next_silence(since, spans), self.state.faults.avoided_until()]
        times += [m.drain_deadline for m in self.state.marks.values()]
        first = min((t for t in times if t is not None and t >= since), default=math.inf)
        return first + self.config.reconcile_interval

    def record_news(self) -> None:
        """Take the events the state noted into the event log."""
        news, self.state.news = self.state.news, []
        for kind, reason, regarding, message in news:
            self.events.record(kind, reason, regarding, message)

    # -- routing ---------------------------------------------------------------------------

    def publish(self, catalog: Catalog, keys: list[RoutedKey]) -> None:
        """Publish the routing table; the publisher's tasks push it to the routers.

        Nothing is published while settling: the table is still empty of what agents have yet
        to report, and a router keeps serving from the one it holds. Nor before a node has
        reported, when nodes held replicas as the term began (the roster, or a leader before
        this one): a table then would be empty of every replica.
        """
        if self.settling(self.monotonic()):
            return
        if (self.took_over or self.roster) and not self.state.nodes:
            return
        models = self.routing.models(catalog, self.autoscaler.wanted(catalog))
        self.publisher.publish(catalog.version, models, keys)
        self.state.mark_unrouted(self.publisher.version)

    def release_retired(self, now: float) -> None:
        """Let go of the retiring replicas every router has stopped routing to, and tell the
        agents of those put to sleep to put them to sleep."""
        routed = self.publisher.routed_version()
        self.state.adapters.swap(routed, now)
        for rid, why in self.state.leaving.tell_sleepers(routed, now):
            log.info("replica %s is out of every routing table; its engine sleeps (%s)", rid, why)
        released = self.state.leaving.release(routed, now)
        for rid, why in released:
            log.info("replica %s is out of every routing table; stopping it (%s)", rid, why)
            self.events.normal(
                "ReplicaStopped", f"replica/{rid}", f"out of every router's table; stopping: {why}"
            )
        if released:
            # The release that empties a draining node says so now: an operator who uncordons
            # it as soon as it is empty left no pass after it to see it drained.
            self.node_news.note_drains()

    def roster_now(self, now: float) -> frozenset[str]:
        """What the next term waits for: the nodes that hold replicas now, and those of the
        roster this term began with that have not reported to it yet, until they would be
        forgotten. (A term that settled by its bound, its agents still on a frozen leader,
        once kept an empty roster: the term after it settled at once and placed anew.)"""
        holding = self.state.holding_nodes()
        if self.roster is None or now - self.started_at >= self.config.node_forget_after:
            return holding
        return holding | (self.roster - self.state.nodes.keys())

    def cold_start(self, catalog: Catalog, models: Collection[str], now: float) -> list[str]:
        """While the store is down (`Leadership.standing_in`): one replica of each of
        `models` (at zero replicas, requests held for it) placed on the nodes its last
        replica ran on, if they have room; nothing else is planned, moved or stopped. The
        models started."""
        s = self.state
        started = []
        for model in models:
            nodes = s.last_placed.get(model)
            if nodes is None or catalog.get(model) is None or s.of_model(model):
                continue
            inputs = self.plan_inputs(catalog, now)
            inputs["nodes"] = [n for n in inputs["nodes"] if n.name in nodes]
            inputs["wanted"] = {**inputs["wanted"], model: 1}
            decided = plan(catalog, s.planned(), s.serving(), models={model}, **inputs)
            if not decided.new:
                if model not in self._cold_refused:  # said once per term
                    self._cold_refused.add(model)
                    log.warning("%s cannot start on %s, where it ran last, while the store "
                                "is down", model, ", ".join(nodes))  # fmt: skip
                continue
            kept = tuple(p for p in s.pending if p.model != model)
            decided = dataclasses.replace(decided, stop=(), sleep=(), wake=(), pending=kept)
            created = s.apply(decided, catalog, now, self.config.retire_timeout)
            tell_placed(self.events, created, decided.new)
            started.append(model)
        return started

    # -- load ------------------------------------------------------------------------------

    def place_adapters(self, catalog: Catalog) -> bool:
        """Decide which LoRA adapters each replica holds, from the requests the routers hold
        for adapters no replica holds (the agents told load and unload). True: a replica was
        told another set."""
        now = self.monotonic()
        if self.settling(now):
            return False
        demand = self.adapter_demand(catalog)
        busy = self.replica_loads()
        return self.state.adapters.place(catalog, demand, now, ADAPTER_SWAP_GRACE_S, busy) > 0

    def adapter_demand(self, catalog: Catalog) -> dict[str, dict[str, Want]]:
        """Model -> adapter -> how much it is wanted: the requests the routers hold for it
        (waiting for it to be loaded somewhere) and how long the oldest has waited, and how
        many a second they were asked for it lately."""
        loads = self.loads.loads(self.monotonic()) or {}
        return {
            spec.name: {
                a.name: Want(loads[a.name].held, loads[a.name].rate, loads[a.name].waited)
                for a in spec.adapters
                if a.name in loads
            }
            for spec in catalog.models
            if spec.adapters
        }

    def replica_loads(self) -> dict[str, float]:
        """The requests each replica carries, as the routers last said (none: unknown)."""
        loads = self.loads.loads(self.monotonic()) or {}
        return {rid: n for load in loads.values() for rid, n in load.replicas.items()}

    def replacing(self) -> set[str]:
        """Models with a replica being replaced: on a draining node, or being moved."""
        s = self.state
        draining = {n for n, m in s.marks.items() if m.mark is Mark.DRAINING}
        models = set()
        for rid, record in s.replicas.items():
            if record.retiring:
                continue
            if rid in s.moving or any(p.node in draining for p in record.replica.shards):
                models.add(record.replica.model)
        return models
