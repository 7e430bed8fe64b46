"""`ControlPlane`: the control plane as a whole, for as long as its process runs.

It holds what outlives a term: the store and its calls, what is desired (the catalog, keys,
join tokens and credentials), the lease, the publisher, the routers' loads and usage, the
event log, and its loops. What it learns of the fleet while it leads belongs to its `Term`
(`term.py`), made anew at each election and dropped with the lease. The reconcile loop runs
every `reconcile_interval` seconds and at once after a report, a mark or a catalog swap that
changed something; each pass that changes the routing table is pushed to every router
(`publisher.py`), and a replica taken out of service is stopped only after every router has
confirmed a table without it. The listeners (`agent_api.py`, `admin_api.py`) call into it;
`service.py` runs it all as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from modelfleet.controlplane.assignments import Assignments
from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalogs import Applied, CatalogKeeper
from modelfleet.controlplane.config import (
    ROUTING_EPOCH_KEY,
    ControlPlaneConfig,
    Heartbeats,
)
from modelfleet.controlplane.doors import Doors
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
from modelfleet.controlplane.series import Recorder, RouterSeries
from modelfleet.controlplane.state import FleetState
from modelfleet.controlplane.term import Term
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.core.fleet import Mark
from modelfleet.core.reconcile import Move, Preview
from modelfleet.host.clock import SYSTEM_CLOCK, Clock, wait_set
from modelfleet.messages import admin
from modelfleet.messages.wire import EngineClient, JoinAnswer, JoinRequest
from modelfleet.security.pki import CertificateAuthority
from modelfleet.store import (
    StoredCredential,
    StoredEvent,
    StoredJoinToken,
    StoredKey,
    StoredMark,
    StoreError,
)
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")
MIN_AUTOSCALE_WAIT_S = 0.02  # a decision due already (and not taken: settling) waits this
STORE_DEADLINE_S = 0.9  # the longest a store call is waited for (`StoreCalls`)
ROSTER_KEY = "roster"  # in the store: the nodes that hold replicas (`keep_roster`)
ROSTER_EVERY_S = 5.0


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
    roster: frozenset[str] | None  # the nodes that held replicas, as the term before kept them


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
        self.recorder = Recorder(config.series_interval, self.calls, clock.time)
        self.series = RouterSeries(config.routers, self._http, self.recorder)
        self.usage = UsageCollector(
            config.routers, self._http, self.calls, config.usage_interval, clock.time, self.recorder
        )
        self.metrics = ControlPlaneMetrics()
        self.doors = Doors(self.metrics, clock.monotonic)
        self.events = EventLog(
            self.store, clock.time, source=f"control-plane {holder_name(config.state_dir)}"
        )
        self.loads = LoadCollector(config.routers, self._http, clock.monotonic, self.events)
        self.publisher = Publisher(
            config.routers,
            self._http,
            0,  # the routing epoch of the term this one leads: set when elected
            config.push_interval,
            self.metrics,
            self.events,
            acting=self.acting,
            confirmed=self._routers_confirmed,
            engine_client=None if ca is None else router_client(ca),
        )
        self.usage.acting = self.acting
        self.recorder.acting = self.acting
        self.loads.acting = self.acting
        self.leadership = Leadership(
            self.store,
            holder_name(config.state_dir),
            config.lease_ttl,
            clock.monotonic,
            self.events,
        )
        self.watch = AssignmentWatch()
        self._beginning = False  # a term's store I/O under way: elected, not acting yet
        self.logs = LogRelay(self.watch)
        self._file_error = ""
        self.last_plan_s: float | None = None  # how long the last pass that planned took
        self.last_idle_pass_s: float | None = None  # and the last that did not
        self._told_no_routers = False  # warned that autoscaled models have no load to follow
        self._usage_totals: dict[str, tuple[int, int, float]] = {}  # as last read
        self._roster: tuple[frozenset[str] | None, float] = (None, -math.inf)  # stored, when
        # What this control plane knows of the fleet: a term of its own while it leads, one
        # that acts on nothing while it follows (`Term`).
        self.term = self._new_term(None, None)
        self.metrics.watch(self)
        # At the start, before any event loop runs: what is desired, and the lease (it leads
        # from the start unless another control plane does).
        self._take_desired(self._read_desired(), marks=False)
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

    def store_time(self) -> float:
        """Now, by the store's clock, for the expiries this control plane writes (keys, join
        tokens): another control plane checks them after a failover, and a host clock 120 s
        ahead made a join token expired right after one. Its own clock before the first
        renewal."""
        now = self.leadership.store_time()
        return self.clock.time() if now is None else now

    def acting(self) -> bool:
        """Whether this control plane leads now: only then does it reconcile, push tables,
        apply catalogs, collect usage, answer agents and take writes."""
        return self.leadership.acting() and not self._beginning

    @property
    def state(self) -> FleetState:
        """What this control plane knows of the fleet in its term now."""
        return self.term.state

    @property
    def assignments(self) -> Assignments:
        return self.term.assignments

    @property
    def routing(self) -> RoutingTable:
        return self.term.routing

    @property
    def autoscaler(self) -> Autoscaler:
        return self.term.autoscaler

    def _new_term(self, epoch: int | None, start: TermStart | None) -> Term:
        autoscaler = Autoscaler(self.calls, self.events, self.clock.time)
        return Term(
            epoch,
            self.clock.monotonic(),
            self.config,
            self.events,
            self.publisher,
            self.loads,
            autoscaler,
            self.clock.monotonic,
            roster=None if start is None else start.roster,
            took_over=self.leadership.took_over,
        )

    def _term_io(self) -> TermStart:
        """The store I/O a new term begins with (run off the event loop, but at the start):
        what is desired read again (another leader may have changed it), the nodes that held
        replicas (the roster the term before kept), this control plane's catalog file applied
        if it changed since it last read it, and a routing epoch newer than any a router
        holds, taken by a fenced write."""
        desired = self._read_desired()
        roster = self.store.get_meta(ROSTER_KEY)
        applied = self.catalogs.lead(self.clock.time())
        epoch = int(self.store.get_meta(ROUTING_EPOCH_KEY) or 0) + 1
        self.store.set_meta(ROUTING_EPOCH_KEY, str(epoch))
        held = None if roster is None else frozenset(json.loads(roster))
        return TermStart(desired, applied, epoch, held)

    def _begin_term(self, start: TermStart) -> None:
        """A new term begins with this control plane leading, from what `_term_io` read, and
        from nothing else: what the term before learned is dropped. It settles (adopts what
        agents report before it plans) and publishes no table until nodes report."""
        self.term = self._new_term(self.leadership.leading_epoch, start)
        self._roster = (start.roster, self.clock.monotonic())
        self._take_desired(start.desired, marks=True)
        if start.applied is not None:
            self.catalog_event(start.applied, self.catalogs.current_info.source)
        self.publisher.new_term(start.routing_epoch)
        log.info(
            "term of epoch %s begins: settling until %s node(s) report",
            self.term.epoch,
            "the roster's " + str(len(start.roster)) if start.roster is not None else "the",
        )

    def _end_term(self) -> None:
        """The lease is lost: what this term learned is dropped; a follower's term acts on
        nothing."""
        self.term = self._new_term(None, None)

    async def lease_loop(self) -> None:
        """Take or renew the lease every third of its TTL; begin a term when elected."""
        while True:
            await asyncio.sleep(self.leadership.interval)
            await self.renew_lease()

    async def renew_lease(self) -> Turn:
        """One renewal of the lease, and what it means for the term."""
        was = self.acting()
        turn = await self.leadership.renew(self.calls)
        if turn is Turn.ELECTED:
            # Not acting until the term has begun: a key made meanwhile went into the keys
            # the term then replaced with what it had read before (the store kept it; this
            # control plane's answers lost it until the next term).
            self._beginning = True
            try:
                self._begin_term(await self.calls(self._term_io))
            except (StoreError, OSError, CatalogInvalid) as exc:
                self.leadership.abandon(str(exc))
            finally:
                self._beginning = False
        elif turn is Turn.LOST:
            self._end_term()
        if self.acting() and not was:
            self.wake()
        return turn

    def wake(self) -> None:
        """Run the next reconcile pass now: something it plans from has changed."""
        self._wake.set()

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
        wall, mono = self.clock.time(), self.clock.monotonic()
        for m in desired.marks:
            deadline = None if m.drain_deadline is None else mono + (m.drain_deadline - wall)
            self.state.set_mark(m.node, NodeMark(Mark(m.mark), deadline))

    async def create_key(self, request: admin.KeyCreate) -> tuple[str, StoredKey]:
        """Make a client API key (KeyRefused if not): the key itself, shown this once, and
        what is stored of it. Every router takes it with its next routing table."""
        models = [m.name for m in self.catalogs.current.models]
        key, stored = await self.keys.create(request, models, self.store_time())
        self.events.normal("KeyCreated", f"key/{stored.name}", f"prefix {stored.prefix}")
        self.wake()
        return key, stored

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

    async def join(self, token: str, request: JoinRequest, source: str) -> JoinAnswer:
        """Give a node its credential for a join token, the join having come from address
        `source` (MembershipRefused if not). A name the fleet knows is never given again: a
        node that reports (with the shared agent token too), or one the term waits for; a node
        revoked before, joining anew, is no longer revoked."""
        node = request.node
        mark = self.state.marks.get(node)
        revoked = mark is not None and mark.mark is Mark.REVOKED
        known = node in self.state.nodes or node in (self.term.roster or ())
        if known and not revoked and not self.membership.has_joined(node):
            raise MembershipRefused(
                409,
                f"node {node} is a node of the fleet already (it reports with the shared agent "
                f"token): pick another name, or, once that machine is gone for good, delete it "
                f"(`modelfleet ctl nodes delete {node}`) and join again",
            )
        answer = await self.membership.join(
            token, request, self.store_time(), source, self.reserved_names()
        )
        if revoked:
            await self.set_mark(node, Mark.NONE, 0)
        log.info("node %s joined", node)
        self.events.normal("NodeJoined", f"node/{node}", "joined with a join token")
        return answer

    def reserved_names(self) -> set[str]:
        """The hosts a control plane or router of this fleet is reached by: a node's
        certificate names none of them."""
        names = set(self.config.certificate_names())
        urls = [r.url for r in self.config.routers]
        for plane in self.leadership.planes:
            urls += [plane.agent_url, plane.admin_url]
        names.update(host for url in urls if (host := urlsplit(url).hostname))
        return names

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

    async def preview(self, catalog: Catalog, marks: Mapping[str, Mark] | None = None) -> Preview:
        """What the next passes would start and stop to make `catalog` true (with `marks` on
        those nodes instead of theirs, for a mark's dry run), the first exactly as the next
        pass plans it (`Term.preview_work`), worked out in a worker thread so that agents'
        reports and the reconcile loop go on meanwhile."""
        work = self.term.preview_work(catalog, self.clock.monotonic(), marks)
        return await asyncio.to_thread(work)

    # -- reconcile and publish: the term's, for this control plane's loops and tests ------

    @property
    def passes(self) -> int:
        return self.term.passes

    @property
    def plans(self) -> int:
        return self.term.plans

    @property
    def frozen(self) -> str:
        return self.term.frozen

    def settling(self, now: float) -> bool:
        return self.term.settling(now)

    def reconcile_once(self, now: float) -> None:
        self.term.reconcile_once(self.catalogs.current, now)

    def replan(self) -> None:
        self.term.replan()

    def retime(self) -> Heartbeats:
        return self.term.retime()

    def place_adapters(self) -> bool:
        return self.term.place_adapters(self.catalogs.current)

    def publish(self) -> None:
        self.term.publish(self.catalogs.current, self.keys.routed())

    def release_retired(self, now: float) -> None:
        self.term.release_retired(now)

    def record_news(self) -> None:
        self.term.record_news()

    def replica_loads(self) -> dict[str, float]:
        return self.term.replica_loads()

    def rebalance(self, model: str | None, dry_run: bool) -> tuple[Move, ...]:
        """See `Term.rebalance`; a move is planned at once."""
        moves = self.term.rebalance(self.catalogs.current, model, dry_run)
        if not dry_run:
            self.wake()
        return moves

    def _routers_confirmed(self) -> None:
        """Every router holds the current table: an adapter swap waiting for it goes on now
        (not at the next pass)."""
        if self.state.swaps_waiting():
            self.wake()

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
            self.catalogs.current, self.loads.loads(now), now, self.term.replacing()
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
            await self.keep_roster()
            await wait_set(self._wake, self.config.reconcile_interval)

    async def clear_forgotten_marks(self) -> None:
        """Take the marks of the nodes a pass forgot out of the store (a mark of a node
        nobody knows does no harm meanwhile: tried again after the next pass)."""
        term = self.term
        for node in list(term.forgotten):
            try:
                await self.calls(self.store.clear_mark, node)
            except StoreError as exc:
                log.debug("cannot clear the mark of forgotten node %s yet: %s", node, exc)
                return
            term.forgotten.discard(node)

    async def keep_roster(self) -> None:
        """Keep in the store the nodes that hold replicas (at most every ROSTER_EVERY_S, and
        never while settling, when what is known is partial): the next term, here or on
        another control plane, settles until they have reported."""
        now = self.clock.monotonic()
        stored, at = self._roster
        if self.term.settling(now) or now - at < ROSTER_EVERY_S:
            return
        roster = self.term.roster_now(now)
        if roster == stored:
            return
        try:
            await self.calls(self.store.set_meta, ROSTER_KEY, json.dumps(sorted(roster)))
        except StoreError as exc:
            log.debug("cannot keep the roster yet: %s", exc)
            return
        self._roster = (roster, now)

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


def router_client(ca: CertificateAuthority) -> EngineClient:
    """What this control plane sends its routers to reach engines behind gates: the CA, and
    a router certificate issued at its start (by the wall clock: it is checked by others)."""
    issued = ca.issue_router_client(datetime.datetime.now(datetime.UTC))
    return EngineClient(
        ca=ca.cert_pem.decode(), cert=issued.cert_pem.decode(), key=issued.key_pem.decode()
    )
