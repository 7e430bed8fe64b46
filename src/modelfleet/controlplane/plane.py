"""`ControlPlane`: the control plane's state and its loops, around `FleetState`, the
`CatalogKeeper` and the pure planner.

The reconcile loop runs every `reconcile_interval` seconds and at once after a report, a mark
or a catalog swap that changed something. A pass plans only when something it plans from
changed since the last one that did, or a time it plans by came (a node goes silent, a drain's
grace ends), or `reconcile_full_interval` has passed: an idle pass at any fleet size costs next
to nothing. Each pass that changes the routing table is pushed to every router
(`publisher.py`). A replica taken out of service is stopped only after every
router has confirmed a table without it. The listeners (`agent_api.py`, `admin_api.py`) call
into it; `service.py` runs it all as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import httpx

from modelfleet.catalog import Catalog, CatalogInvalid
from modelfleet.clock import SYSTEM_CLOCK, Clock, wait_set
from modelfleet.controlplane.assignments import Assignments
from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalogs import Applied, CatalogKeeper
from modelfleet.controlplane.config import (
    DEFAULT_SETTLE_FOR_S,
    ROUTING_EPOCH_KEY,
    ControlPlaneConfig,
    Heartbeats,
)
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.keys import KeyBook
from modelfleet.controlplane.leadership import Leadership, Turn, holder_name
from modelfleet.controlplane.loads import LoadCollector
from modelfleet.controlplane.logs import LogRelay
from modelfleet.controlplane.membership import Membership, MembershipRefused
from modelfleet.controlplane.metrics import ControlPlaneMetrics
from modelfleet.controlplane.publisher import Publisher
from modelfleet.controlplane.records import NodeMark
from modelfleet.controlplane.routing import RoutingTable
from modelfleet.controlplane.series import RouterSeries
from modelfleet.controlplane.state import FleetState
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.fleet import Mark
from modelfleet.pki import CertificateAuthority
from modelfleet.reconcile import Move, Preview, plan, preview, rebalance, settling
from modelfleet.residency import Want
from modelfleet.store import (
    StoredCredential,
    StoredEvent,
    StoredJoinToken,
    StoredKey,
    StoredMark,
    StoreError,
)
from modelfleet.store.calls import StoreCalls
from modelfleet.wire import JoinAnswer, JoinRequest

log = logging.getLogger("modelfleet.controlplane")
MIN_AUTOSCALE_WAIT_S = 0.02  # a decision due already (and not taken: settling) waits this
# A replica's adapter swap waits for every router to stop sending it requests for what it lets
# go; a router that does not confirm holds it up no longer than this.
ADAPTER_SWAP_GRACE_S = 5.0
STORE_DEADLINE_S = 0.9  # the longest a store call is waited for (`StoreCalls`)


@dataclass(frozen=True)
class Desired:
    """What is desired besides the catalog, as the store held it at one read."""

    keys: list[StoredKey]
    tokens: list[StoredJoinToken]
    credentials: list[StoredCredential]
    marks: list[StoredMark]
    autoscale: str | None  # the autoscaled models' counts, as the autoscaler keeps them


@dataclass(frozen=True)
class TermStart:
    """What a new term begins from (`ControlPlane._term_io`)."""

    desired: Desired
    applied: Applied | None  # the catalog file, applied as the term began
    routing_epoch: int


class MarkRefused(RuntimeError):
    """An operator's mark that cannot be set: the node is unknown (404) or revoked (409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NodeBusy(RuntimeError):
    """A node that still holds replicas cannot be deleted without force."""

    def __init__(self, node: str, replicas: list[str]) -> None:
        super().__init__(
            f"node {node} holds replica(s) {', '.join(replicas)}: drain it first, or delete it "
            "with force to place them anew elsewhere at once"
        )
        self.replicas = replicas


class ControlPlane:
    """The control plane's services around one `FleetState` and one `CatalogKeeper`."""

    def __init__(
        self,
        config: ControlPlaneConfig,
        catalogs: CatalogKeeper,
        http: httpx.AsyncClient | None = None,  # how it reaches routers; tests pass a mock
        clock: Clock = SYSTEM_CLOCK,
        ca: CertificateAuthority | None = None,  # the fleet's CA; None: no joins
    ) -> None:
        self.config = config
        self.catalogs = catalogs
        self.clock = clock
        self.state = FleetState(stale_after=config.node_stale_after)
        self.assignments = Assignments(self.state)
        self.routing = RoutingTable(self.state)
        self.started_at = clock.monotonic()
        self.settle_for = config.settle_for or DEFAULT_SETTLE_FOR_S
        self._settled = False
        self._wake = asyncio.Event()
        self._http = http or httpx.AsyncClient(timeout=5)
        self.store = catalogs.store
        # Every store call from here on runs off the event loop, bounded (`store/calls.py`):
        # within a second, so that every request is answered within one, whatever the store
        # does; and below the lease's TTL, so that a renewal never outlasts it.
        deadline = min(STORE_DEADLINE_S, max(0.2, 2 * config.lease_ttl / 3))
        self.calls = StoreCalls(self.store, deadline, clock.time)
        self.keys = KeyBook(self.calls)
        self.ca = ca
        self.membership = Membership(self.calls, ca)
        self.usage = UsageCollector(
            config.routers, self._http, self.calls, config.usage_interval, clock.time
        )
        self.series = RouterSeries(config.routers, self._http, config.series_interval, clock.time)
        self.metrics = ControlPlaneMetrics()
        self.events = EventLog(
            self.store, clock.time, source=f"control-plane {holder_name(config.state_dir)}"
        )
        self.loads = LoadCollector(config.routers, self._http, clock.monotonic, self.events)
        self.autoscaler = Autoscaler(self.calls, self.events, clock.time)
        self._silent: dict[str, set[str]] = {"stale": set(), "lost": set()}
        self._drained: set[str] = set()  # draining nodes told drained
        self.publisher = Publisher(
            config.routers,
            self._http,
            0,  # the routing epoch of the term this one leads: set when elected
            config.push_interval,
            self.metrics,
            self.events,
            acting=self.acting,
            confirmed=self._routers_confirmed,
        )
        self.usage.acting = self.acting
        self.loads.acting = self.acting
        self.leadership = Leadership(
            self.store,
            holder_name(config.state_dir),
            config.lease_ttl,
            clock.monotonic,
            self.events,
        )
        # Took the lease from another control plane, and has heard from no node since.
        self._took_over = False
        self.watch = AssignmentWatch()
        self.logs = LogRelay(self.watch)
        self._file_error = ""
        self.passes = 0  # reconcile passes made (after settling), for operators and tests
        self.plans = 0  # those of them that planned: the others had nothing new to plan from
        self.last_plan_s: float | None = None  # how long the last pass that planned took
        self.last_idle_pass_s: float | None = None  # and the last that did not
        # What the last pass that planned planned from (the table's change count, the
        # catalog's digest), when it ran, and the next time a pass must plan with nothing new.
        self._planned: tuple[int, str] | None = None
        self._planned_at = 0.0
        self._due = 0.0
        # What the last pass that planned the whole fleet planned from: when only the routing
        # stamps of some models moved on since, the next plans those models only.
        self._planned_whole: tuple[int, str, int] | None = None  # membership, catalog, stamp
        self._planned_stamp = 0
        self._whole_at = 0.0
        self.planned_models: int | None = None  # how many models the last plan planned
        self.frozen = ""  # the last pass's `Plan.frozen`: why nothing moves off lost nodes
        self._told_no_routers = False  # warned that autoscaled models have no load to follow
        self._unmarked: set[str] = set()  # forgotten nodes whose marks the store still holds
        self._usage_totals: dict[str, tuple[int, int, float]] = {}  # as last read
        self.retime()
        self.metrics.watch(self)
        # At the start, before any event loop runs: what is desired, and the lease (it leads
        # from the start unless another control plane does).
        self._take_desired(self._read_desired(), marks=True)
        if self.leadership.renew_now() is Turn.ELECTED:
            try:
                self._begin_term(self._term_io())
            except (StoreError, OSError, CatalogInvalid) as exc:
                self.leadership.abandon(str(exc))
        role = (
            f"leading, routing epoch {self.publisher.epoch}"
            if self.leadership.leading_epoch is not None
            else f"following {self.leadership.leader}"
        )
        self.events.normal(
            "ControlPlaneStarted",
            "control-plane/self",
            f"{role}, catalog version {catalogs.current.version}",
        )

    def acting(self) -> bool:
        """Whether this control plane leads now: only then does it reconcile, push tables,
        apply catalogs, collect usage, answer agents and take writes."""
        return self.leadership.acting()

    def _term_io(self) -> TermStart:
        """The store I/O a new term begins with (run off the event loop, but at the start):
        what is desired read again (another leader may have changed it), this control
        plane's catalog file applied if it changed since it last read it, and a routing epoch
        newer than any a router holds, taken by a fenced write."""
        desired = self._read_desired()
        applied = self.catalogs.lead(self.clock.time())
        epoch = int(self.store.get_meta(ROUTING_EPOCH_KEY) or 0) + 1
        self.store.set_meta(ROUTING_EPOCH_KEY, str(epoch))
        return TermStart(desired, applied, epoch)

    def _begin_term(self, start: TermStart) -> None:
        """A new term begins with this control plane leading, from what `_term_io` read: a
        settling window (it adopts what agents report before it plans)."""
        self._take_desired(start.desired, marks=True)
        if start.applied is not None:
            self.catalog_event(start.applied, self.catalogs.current_info.source)
        self.publisher.new_term(start.routing_epoch)
        self.started_at = self.clock.monotonic()
        self._settled = False
        self._took_over = self.leadership.took_over

    async def lease_loop(self) -> None:
        """Take or renew the lease every third of its TTL; begin a term when elected."""
        while True:
            await asyncio.sleep(self.leadership.interval)
            was = self.acting()
            if await self.leadership.renew(self.calls) is Turn.ELECTED:
                try:
                    self._begin_term(await self.calls(self._term_io))
                except (StoreError, OSError, CatalogInvalid) as exc:
                    self.leadership.abandon(str(exc))
            if self.acting() and not was:
                self.wake()

    def wake(self) -> None:
        """Run the next reconcile pass now: something it plans from has changed."""
        self._wake.set()

    def retime(self) -> Heartbeats:
        """The heartbeat interval and silences for the fleet's size now (the state's stale
        time follows them)."""
        timing = self.config.heartbeats(len(self.state.nodes))
        self.state.stale_after = timing.stale_after
        return timing

    @property
    def planned_at(self) -> float:
        """When the last pass that planned ran."""
        return self._planned_at

    def replan(self) -> None:
        """Make the next pass plan, the whole fleet, even when nothing it plans from changed."""
        self._planned = None
        self._planned_whole = None

    def notify_assignments(self) -> None:
        """Answer the heartbeats held for nodes whose assignment may have changed."""
        self.watch.notify(self.state.changed_assignments(self.catalogs.current))

    # -- marks -----------------------------------------------------------------------------

    async def read_desired(self) -> None:
        """Read again what the store holds of what is desired (keys, join tokens and
        credentials, the current catalog, the counts of autoscaled models): what a follower
        answers is what the store holds at the time of the read, not what it read before."""
        self._take_desired(await self.calls(self._read_desired), marks=False)

    def _read_desired(self) -> Desired:
        """What is desired, as the store holds it now (store I/O: off the event loop)."""
        self.catalogs.reload()
        s = self.store
        return Desired(
            s.api_keys(), s.join_tokens(), s.credentials(), s.marks(), self.autoscaler.stored()
        )

    def _take_desired(self, desired: Desired, marks: bool) -> None:
        """Hold what `_read_desired` read; with `marks`, the nodes' marks too (a term begins):
        marks persist, their deadlines moved onto the monotonic clock."""
        self.keys = KeyBook(self.calls, desired.keys)
        self.membership = Membership(self.calls, self.ca, desired.tokens, desired.credentials)
        self.autoscaler.load(desired.autoscale)
        if not marks:
            return
        for node in list(self.state.marks):
            self.state.set_mark(node, NodeMark(Mark.NONE, None))
        wall, mono = self.clock.time(), self.clock.monotonic()
        for m in desired.marks:
            deadline = None if m.drain_deadline is None else mono + (m.drain_deadline - wall)
            self.state.set_mark(m.node, NodeMark(Mark(m.mark), deadline))

    async def mark_node(self, node: str, mark: Mark, grace: float | None) -> Mark:
        """An operator's cordon, drain (bounded by `grace` seconds, or the configured
        `drain_grace` when None) or uncordon of `node`; returns the mark it had. Raises
        MarkRefused for a node that never reported or was revoked."""
        if node not in self.state.nodes:
            known = ", ".join(sorted(self.state.nodes)) or "none has reported yet"
            raise MarkRefused(404, f"no node {node!r} has reported (nodes: {known})")
        if self.state.nodes[node].mark.mark is Mark.REVOKED:
            raise MarkRefused(409, f"node {node} was revoked: it comes back only by joining anew")
        grace = self.config.drain_grace if grace is None else grace
        return await self.set_mark(node, mark, grace)

    async def set_mark(self, node: str, mark: Mark, grace: float) -> Mark:
        """Mark `node` (a drain bounded by `grace` seconds; 0: no bound), persist it, and
        return the mark it had."""
        wall, mono = self.clock.time(), self.clock.monotonic()
        bounded = mark is Mark.DRAINING and grace > 0
        if mark is Mark.NONE:
            await self.calls(self.store.clear_mark, node)
        else:
            stored = StoredMark(node, mark.value, wall, wall + grace if bounded else None)
            await self.calls(self.store.set_mark, stored)
        was = self.state.marks.get(node)  # as it is now, after the write
        self.state.set_mark(node, NodeMark(mark, mono + grace if bounded else None))
        self.wake()
        previous = was.mark if was else Mark.NONE
        log.info("node %s marked %s (was %s)", node, mark.value, previous.value)
        bound = f", {grace:.0f}s of grace" if bounded else ""
        self.events.normal(
            "NodeMarked", f"node/{node}", f"marked {mark.value}{bound} (was {previous.value})"
        )
        return previous

    def rebalance(self, model: str | None, dry_run: bool) -> tuple[Move, ...]:
        """The moves that even out spread models over the nodes that can host them (one
        model, or all); unless `dry_run`, each moving replica is replaced elsewhere,
        make-before-break and `max_parallel` at a time, as in a drain."""
        s = self.state
        moves = rebalance(
            self.catalogs.current,
            s.planned(),
            s.node_list(),
            s.busy_slots(),
            self.clock.monotonic(),
            s.stale_after,
            None if model is None else {model},
        )
        if not dry_run:
            for move in moves:
                s.move(move.replica_id, move.reason)
                log.info(
                    "moving replica %s off %s: %s", move.replica_id, move.from_node, move.reason
                )
            self.wake()
        return moves

    async def delete_node(self, node: str, force: bool) -> list[str]:
        """Forget `node`. Refused (NodeBusy) while replicas run on it, unless `force`: then
        they are taken out of service at once and placed anew elsewhere. Returns their ids."""
        held = self.state.holding(node)
        if held and not force:
            raise NodeBusy(node, held)
        await self.calls(self.store.clear_mark, node)  # first: a refused write changes nothing
        held = self.state.holding(node)  # as it is now, after the write
        self.state.retire(held, f"node {node} deleted by an operator", self.clock.monotonic())
        self.state.forget(node)
        self.wake()
        retired = f"; replicas retired: {', '.join(held)}" if held else ""
        log.info("node %s deleted%s", node, retired)
        self.events.normal("NodeDeleted", f"node/{node}", f"deleted by an operator{retired}")
        return held

    async def join(self, token: str, request: JoinRequest) -> JoinAnswer:
        """Give a node its credential for a join token (MembershipRefused if not). A node
        revoked before, joining anew, is no longer revoked."""
        answer = await self.membership.join(token, request, self.clock.time())
        node = request.node
        record = self.state.nodes.get(node)
        if record is not None and record.mark.mark is Mark.REVOKED:
            await self.set_mark(node, Mark.NONE, 0)
        log.info("node %s joined", node)
        self.events.normal("NodeJoined", f"node/{node}", "joined with a join token")
        return answer

    async def revoke_node(self, node: str) -> list[str]:
        """Cut `node` off: delete its credential, so that nothing it sends is taken, and mark
        it revoked, so that its replicas are replaced elsewhere as a lost node's are. Returns
        them. MembershipRefused when the node holds no credential (it reports with the fleet's
        shared agent token, which cannot be taken from one node)."""
        if not self.membership.has_joined(node):
            if node in self.state.nodes:
                raise MembershipRefused(
                    409,
                    f"node {node} reports with the fleet's shared agent token, which cannot be "
                    "revoked for one node: change agent_token, or join nodes with join tokens",
                )
            raise MembershipRefused(404, f"no node {node!r} has joined")
        await self.membership.revoke_node(node)
        replacing = self.state.holding(node)
        if node in self.state.nodes:
            await self.set_mark(node, Mark.REVOKED, 0)
        moved = f"; its replicas are replaced elsewhere: {', '.join(replacing)}"
        log.warning(
            "node %s revoked: its credential is deleted%s", node, moved if replacing else ""
        )
        self.events.warning(
            "NodeRevoked", f"node/{node}", f"credential revoked{moved if replacing else ''}"
        )
        return replacing

    def forget_silent(self, now: float) -> None:
        """Forget nodes silent for `node_forget_after` that hold no replica."""
        for name in self.state.silent_for(self.config.node_forget_after, now):
            if not self.state.holding(name):
                silent = now - self.state.nodes[name].received
                log.info(
                    "node %s forgotten: no report for %.0fs and no replica on it", name, silent
                )
                self.events.normal(
                    "NodeForgotten", f"node/{name}", f"no report for {silent:.0f}s, no replica"
                )
                self.state.forget(name)
                self._unmarked.add(name)  # its mark leaves the store after the pass

    async def preview(self, catalog: Catalog) -> Preview:
        """What the next passes would start and stop to make `catalog` true.

        A preview plans up to hundreds of passes: it runs in a worker thread, on a copy of
        what it reads (the table and the nodes are immutable values), so agents' reports and
        the reconcile loop go on meanwhile.
        """
        s = self.state
        args = (catalog, s.planned(), s.node_list(), s.busy_slots(), self.clock.monotonic())
        wanted = self.autoscaler.wanted(catalog)

        def work() -> Preview:
            done = preview(*args, s.stale_after, wanted=wanted)
            for pending in done.pending:
                _ = pending.explanation  # worked out here, not when the answer is built
            return done

        return await asyncio.to_thread(work)

    # -- reconcile and publish -----------------------------------------------------------

    def settling(self, now: float) -> bool:
        """Whether the settling window after the start is still open; once closed, it stays
        closed (and this costs nothing more)."""
        if self._settled:
            return False
        known: Collection[str] = self.config.known_nodes
        reported: Collection[str] = self.state.nodes.keys()
        if len(reported) < len(known):
            # Some known node has not reported: only the window counts, and the names are not
            # compared (on every report of 10,000 nodes coming back, that comparison was most
            # of a restart's cost).
            known = reported = ()
        self._settled = not settling(now, self.started_at, self.settle_for, known, reported)
        return not self._settled

    def reconcile_once(self, now: float) -> None:
        """One pass: plan against what is known, carry the plan out (unless settling, or
        nothing it plans from changed since the last pass that planned)."""
        if self.settling(now):
            return
        self.passes += 1
        s = self.state
        catalog = self.catalogs.current
        timing = self.retime()
        planned_from = (s.version, catalog.digest)
        safety_net = now - self._whole_at >= self.config.reconcile_full_interval
        if now >= self._due:
            # Nodes heard from since the due time was worked out moved it on.
            self._due = self._next_due(self._planned_at, timing)
        due = now >= self._due
        if planned_from == self._planned and not safety_net and not due:
            return
        self.plans += 1
        # Only some models changed (their replicas, or reports of nodes holding them), and
        # nothing that concerns every model (another catalog, a node come or gone, a time come):
        # those are planned, with the ones left pending (what changed may make room for them).
        whole = (s.membership, catalog.digest, s.stamp)
        models: set[str] | None = None
        if (
            self._planned_whole is not None
            and self._planned_whole[:2] == whole[:2]
            and not safety_net
            and not due
        ):
            models = {m.name for m in catalog.models if s.rerouted_at(m.name) > self._planned_stamp}
            models |= {p.model for p in s.pending}
        self.planned_models = len(catalog.models) if models is None else len(models)
        if models is None:
            self._whole_at = now
        self.forget_silent(now)
        self.note_silences(now, timing)
        self.note_drains()
        # Taken before the plan is carried out: what it changes is planned from once more, so
        # anything a pass leaves for the next (a replacement held back) is not left waiting.
        self._planned, self._planned_at = (s.version, catalog.digest), now
        self._planned_whole, self._planned_stamp = whole, s.stamp
        self.restart_groups()
        failed = {}
        for rid, (node, why) in s.failing(self.config.max_failures).items():
            model = s.replicas[rid].replica.model
            s.keep_off(model, node, why, now + self.config.failure_avoid)
            failed[rid] = why
            self.events.warning("ModelKeptOff", f"node/{node}", f"{model} kept off: {why}")
        decided = plan(
            catalog,
            s.planned(),
            s.serving(),
            s.node_list(),
            s.busy_slots(),
            now,
            s.stale_after,
            failed,
            s.avoiding(now),
            timing.lost_after,
            models,
            s.moving,
            self.autoscaler.wanted(catalog),
            self.replica_loads(),
            s.asleep(),
        )
        if decided.frozen != self.frozen:
            if decided.frozen:
                log.warning("%s", decided.frozen)
                self.events.warning("FleetFrozen", "fleet/all", decided.frozen)
            else:
                log.info("nodes report again: lost nodes are handled as usual")
                self.events.normal("FleetThawed", "fleet/all", "nodes report again")
            self.frozen = decided.frozen
        for stop in decided.stop:
            log.info("retiring replica %s: %s", stop.replica_id, stop.reason)
            self.events.normal("ReplicaRetiring", f"replica/{stop.replica_id}", stop.reason)
        for sleep in decided.sleep:
            log.info("putting replica %s to sleep: %s", sleep.replica_id, sleep.reason)
            self.events.normal("ReplicaSleeping", f"replica/{sleep.replica_id}", sleep.reason)
        for wake in decided.wake:
            log.info("waking replica %s: %s", wake.replica_id, wake.reason)
            self.events.normal("ReplicaWaking", f"replica/{wake.replica_id}", wake.reason)
        before = s.pending
        if models is not None:  # the models not planned keep what they had pending
            kept = tuple(p for p in before if p.model not in models)
            decided = dataclasses.replace(decided, pending=kept + decided.pending)
        created = s.apply(decided, catalog, now, self.config.retire_timeout)
        for replica, planned in zip(created, decided.new, strict=True):
            where = ", ".join(f"{p.node}{list(p.gpus)}" for p in replica.shards)
            log.info("placed %s (%s) on %s", replica.id, replica.model, where)
            self.events.normal(
                "ReplicaPlaced",
                f"replica/{replica.id}",
                f"{replica.model} on {where}: {planned.reason}",
            )
        # Pending replicas are logged when their count changes, without the explanation: it
        # judges every node, and at 10,000 nodes going silent, working it out for each model at
        # each pass kept the control plane busy for minutes (even with the line not logged).
        was = {p.model: p.count for p in before}
        for p in decided.pending:
            if was.get(p.model) != p.count:
                log.info(
                    "%d replica(s) of %s pending; `modelfleet ctl explain %s` says why",
                    p.count,
                    p.model,
                    p.model,
                )
                self.events.warning(
                    "ReplicaPending",
                    f"model/{p.model}",
                    f"{p.count} replica(s) cannot be placed now: `ctl explain-placement "
                    f"{p.model}` says why",
                )
        self._due = self._next_due(now, timing)

    def _routers_confirmed(self) -> None:
        """Every router holds the current table: an adapter swap waiting for it goes on now
        (not at the next pass)."""
        if self.state.swaps_waiting():
            self.wake()

    def place_adapters(self) -> bool:
        """Decide which LoRA adapters each replica holds, from the requests the routers hold
        for adapters no replica holds (the agents told load and unload). True: a replica was
        told another set."""
        if self.settling(self.clock.monotonic()):
            return False
        catalog = self.catalogs.current
        demand = self.adapter_demand(catalog)
        now = self.clock.monotonic()
        busy = self.replica_loads()
        return self.state.place_adapters(catalog, demand, now, ADAPTER_SWAP_GRACE_S, busy) > 0

    def adapter_demand(self, catalog: Catalog) -> dict[str, dict[str, Want]]:
        """Model -> adapter -> how much it is wanted: the requests the routers hold for it
        (waiting for it to be loaded somewhere) and how long the oldest has waited, and how
        many a second they were asked for it lately."""
        loads = self.loads.loads(self.clock.monotonic()) or {}
        return {
            spec.name: {
                a.name: Want(loads[a.name].held, loads[a.name].rate, loads[a.name].waited)
                for a in spec.adapters
                if a.name in loads
            }
            for spec in catalog.models
            if spec.adapters
        }

    def read_events(
        self, regarding: str | None = None, since: float = 0.0, after: int = 0, limit: int = 1000
    ) -> list[StoredEvent]:
        """The store's events (as `Store.events`), with those noted so far written first: a
        reader sees what happened up to its read (store I/O: off the event loop)."""
        self.events.flush()
        return self.store.events(regarding, since, after, limit)

    async def usage_totals(self) -> dict[str, tuple[int, int, float]]:
        """Every key's usage so far, read from the store now; as last read while the store
        does not answer."""
        with contextlib.suppress(StoreError):
            self._usage_totals = await self.calls(self.store.usage_totals)
        return self._usage_totals

    def replica_loads(self) -> dict[str, float]:
        """The requests each replica carries, as the routers last said (none: unknown)."""
        loads = self.loads.loads(self.clock.monotonic()) or {}
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

    async def autoscale_once(self, now: float) -> None:
        """Decide the count of every model that follows its load; a change is planned at
        once."""
        if self.settling(now):
            return
        if not self.config.routers and not self._told_no_routers:
            scaled = [m.name for m in self.catalogs.current.models if m.autoscale is not None]
            if scaled:
                self._told_no_routers = True
                log.warning(
                    "%s follow their load, but no router is configured to read it from: "
                    "they keep their autoscale min",
                    ", ".join(scaled),
                )
        changed = await self.autoscaler.step(
            self.catalogs.current, self.loads.loads(now), now, self.replacing()
        )
        if changed:
            self.replan()
            self.wake()

    async def autoscale_loop(self) -> None:
        """Decide every `autoscale_interval` seconds, when a scale-up comes due, and at once
        when a router's load comes (a router answers its long poll at once when a cold model
        gets a request, or a model goes over its target or into a burst)."""
        while True:
            wait = self.config.autoscale_interval
            due = self.autoscaler.next_due(self.catalogs.current)
            if due is not None and self.acting():  # a scale-up due sooner: decide then
                wait = min(wait, max(MIN_AUTOSCALE_WAIT_S, due - self.clock.monotonic()))
            await wait_set(self.loads.news, wait)
            self.loads.news.clear()
            if self.acting():
                await self.autoscale_once(self.clock.monotonic())
                if self.place_adapters():  # a router holds requests for an adapter
                    self.wake()

    def restart_groups(self) -> None:
        """Restart together every shard of each replica of several shards one shard of which
        failed (as LeaderWorkerSet recreates a group): it left the routers' table with the
        report that said so. After `max_failures` restarts in a row that never served, it is
        left to `failing`: placed anew elsewhere, its model kept off the node."""
        s = self.state
        for rid, why in s.broken_groups().items():
            record = s.replicas[rid]
            if record.group_restarts >= self.config.max_failures:
                continue
            count = s.restart_group(rid, why)
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
        times = [self.state.next_silence(since, spans), self.state.avoided_until()]
        times += [m.drain_deadline for m in self.state.marks.values()]
        first = min((t for t in times if t is not None and t >= since), default=math.inf)
        return first + self.config.reconcile_interval

    def release_retired(self, now: float) -> None:
        """Let go of the retiring replicas every router has stopped routing to, and tell the
        agents of those put to sleep to put them to sleep."""
        self.state.swap_adapters(self.publisher.routed_version(), now)
        for rid, why in self.state.tell_sleepers(self.publisher.routed_version(), now):
            log.info("replica %s is out of every routing table; its engine sleeps (%s)", rid, why)
        for rid, why in self.state.release(self.publisher.routed_version(), now):
            log.info("replica %s is out of every routing table; stopping it (%s)", rid, why)
            self.events.normal(
                "ReplicaStopped", f"replica/{rid}", f"out of every router's table; stopping: {why}"
            )

    def catalog_event(self, applied: Applied, source: str) -> None:
        """The event of a catalog applied: its version, from where, what it changes."""
        if not applied.changed:
            return
        new, old = applied.catalog, applied.previous
        before = {m.name: m for m in old.models}
        after = {m.name: m for m in new.models}
        parts = [
            *(f"+{name}" for name in sorted(after.keys() - before.keys())),
            *(f"-{name}" for name in sorted(before.keys() - after.keys())),
            *(
                f"~{name}"
                for name in sorted(after.keys() & before.keys())
                if after[name] != before[name]
            ),
        ]
        changes = " ".join(parts) or "no model changed"
        self.events.normal("CatalogApplied", f"catalog/{new.version}", f"from {source}: {changes}")

    def catalog_refused(self, problems: Sequence[str], source: str) -> None:
        shown = "; ".join(problems[:3]) + (
            f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        )
        self.events.warning("CatalogRefused", "catalog/refused", f"from {source}: {shown}")

    def note_silences(self, now: float, timing: Heartbeats) -> None:
        """Event the nodes that went stale or lost since the last look (those heard from
        again are told by the state, `NodeBack`)."""
        for kind, span in (("stale", timing.stale_after), ("lost", timing.lost_after)):
            silent = set(self.state.silent_for(span, now))
            for node in sorted(silent - self._silent[kind]):
                quiet = now - self.state.nodes[node].received
                self.events.warning(
                    f"Node{kind.capitalize()}", f"node/{node}", f"no word for {quiet:.0f}s"
                )
            self._silent[kind] = silent

    def note_drains(self) -> None:
        """Event each draining node that holds nothing any more, once per drain."""
        draining = {n for n, m in self.state.marks.items() if m.mark is Mark.DRAINING}
        self._drained &= draining
        for node in sorted(draining - self._drained):
            if not self.state.on_node(node):
                self._drained.add(node)
                self.events.normal("NodeDrained", f"node/{node}", "drained: nothing runs there")

    def record_news(self) -> None:
        """Take the events the state noted into the event log."""
        news, self.state.news = self.state.news, []
        for kind, reason, regarding, message in news:
            self.events.record(kind, reason, regarding, message)

    def publish(self) -> None:
        """Publish the routing table; the publisher's tasks push it to the routers.

        Nothing is published while settling: the table is still empty of what agents have yet
        to report, and a router keeps serving from the one it holds.
        """
        if self.settling(self.clock.monotonic()):
            return
        if self._took_over and not self.state.nodes:
            # It took the lease from another and no node has reported to it yet: a table now
            # would be empty of every replica; each router keeps serving from the one it holds.
            return
        catalog = self.catalogs.current
        models = self.routing.models(catalog, self.autoscaler.wanted(catalog))
        self.publisher.publish(catalog.version, models, self.keys.routed())
        self.state.mark_unrouted(self.publisher.version)

    async def reconcile_loop(self) -> None:
        while True:
            if not self.acting():  # a follower plans nothing
                await wait_set(self._wake, self.config.reconcile_interval)
                self._wake.clear()
                continue
            self._wake.clear()
            began, plans = time.perf_counter(), self.plans
            self.reconcile_once(self.clock.monotonic())
            self.place_adapters()
            self.publish()
            self.release_retired(self.clock.monotonic())
            self.notify_assignments()
            self.record_news()
            took = time.perf_counter() - began
            if self.plans > plans:
                self.last_plan_s = took
                self.metrics.pass_seconds.labels("yes").observe(took)
            elif not self.settling(self.clock.monotonic()):
                self.last_idle_pass_s = took
                self.metrics.pass_seconds.labels("no").observe(took)
            await self.clear_forgotten_marks()
            await wait_set(self._wake, self.config.reconcile_interval)

    async def clear_forgotten_marks(self) -> None:
        """Take the marks of the nodes a pass forgot out of the store (a mark of a node
        nobody knows does no harm meanwhile: tried again after the next pass)."""
        for node in list(self._unmarked):
            try:
                await self.calls(self.store.clear_mark, node)
            except StoreError as exc:
                log.debug("cannot clear the mark of forgotten node %s yet: %s", node, exc)
                return
            self._unmarked.discard(node)

    async def catalog_loop(self) -> None:
        """Apply the catalog file whenever its content changes, while leading; while
        following, say once when it changed to a catalog only the leader could apply."""
        while True:
            await asyncio.sleep(self.config.catalog_poll_interval)
            if self.calls.outage is not None:
                continue  # read once the store answers again: nothing could be applied
            if not self.acting():
                try:
                    told = await self.calls(self.catalogs.follow_file)
                except (OSError, StoreError) as exc:
                    told = f"cannot read the catalog file or the store's catalog: {exc}"
                if told is not None and told != self._file_error:
                    self._file_error = told
                    log.warning("%s", told)
                continue
            refused = self.catalogs.last_rejection()
            try:
                applied = await self.calls(self.catalogs.check_file, self.clock.time())
                self._file_error = ""
            except (OSError, StoreError) as exc:
                if str(exc) != self._file_error:  # once per distinct error, not every poll
                    self._file_error = str(exc)
                    what = "read the catalog file" if isinstance(exc, OSError) else "apply it"
                    log.warning("cannot %s: %s; the current catalog stays", what, exc)
                continue
            if applied is not None:
                self.catalog_event(applied, str(self.config.catalog))
            rejection = self.catalogs.last_rejection()
            if rejection is not None and rejection != refused:
                self.catalog_refused(rejection.problems, rejection.source)
            if applied is not None and applied.changed:
                self.wake()

    async def close(self) -> None:
        """At the stop: the lease let go and the events noted written, each bounded by the
        store calls' deadline (a store that does not answer holds up no stop)."""
        for last in (self.leadership.release, self.events.flush):
            try:
                await self.calls.probe(last)
            except StoreError as exc:
                log.warning("at the stop, the store did not answer: %s", exc)
        await self._http.aclose()
        self.calls.close()
        if self.calls.outage is None:
            self.catalogs.store.close()
