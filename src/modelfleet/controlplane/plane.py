"""`ControlPlane`: the control plane as a whole, for as long as its process runs.

It holds what outlives a term: the store and its calls, what is desired (the catalog, keys,
join tokens and credentials), the lease, the publisher, the routers' loads and usage, the
event log, and its loops. What it learns of the fleet while it leads belongs to its `Term`
(`term.py`), made anew at each election and dropped with the lease. The reconcile loop runs
every `reconcile_interval` seconds and at once after a report, a mark or a catalog swap that
changed something; each pass that changes the routing table is pushed to every router
(`publisher.py`), and a replica taken out of service is stopped only after every router has
confirmed a table without it. The listeners (`agent_api.py`, `admin_api/`) call into it;
`service.py` runs it all as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from modelfleet.controlplane.assignments import Assignments
from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalog_file import CatalogFile, applied_event
from modelfleet.controlplane.catalogs import Applied, CatalogKeeper
from modelfleet.controlplane.config import (
    ROUTING_EPOCH_KEY,
    ControlPlaneConfig,
    Heartbeats,
)
from modelfleet.controlplane.doors import Doors
from modelfleet.controlplane.events import EventLog, event_scope
from modelfleet.controlplane.keys import KeyBook, key_names
from modelfleet.controlplane.leadership import Leadership, Turn, holder_name
from modelfleet.controlplane.loads import LoadCollector
from modelfleet.controlplane.logs import LogRelay
from modelfleet.controlplane.membership import Membership
from modelfleet.controlplane.metrics import ControlPlaneMetrics
from modelfleet.controlplane.publisher import Publisher
from modelfleet.controlplane.records import NodeMark
from modelfleet.controlplane.roster import Roster, read_roster
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
from modelfleet.messages.wire import EngineClient
from modelfleet.security.pki import CertificateAuthority
from modelfleet.store import (
    Once,
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


@dataclass(frozen=True)
class Desired:
    """What is desired besides the catalog, as the store held it at one read."""

    keys: list[StoredKey]
    tokens: list[StoredJoinToken]
    credentials: list[StoredCredential]
    revoked: dict[str, float]  # node names revoked or deleted, and when
    marks: list[StoredMark]
    autoscale: str | None  # the autoscaled models' counts, as the autoscaler keeps them


@dataclass(frozen=True)
class TermStart:
    """What a new term begins from (`ControlPlane._term_io`)."""

    desired: Desired
    applied: Applied | None  # the catalog file, applied as the term began
    routing_epoch: int
    roster: frozenset[str] | None  # the nodes that held replicas, as the term before kept them


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
        # A write whose outcome stayed unknown may have landed: the store is read again.
        self._unsure = False
        self.calls.unsure = self._store_unsure
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
            acting=self.serving_fleet,
            confirmed=self._routers_confirmed,
            engine_client=None if ca is None else router_client(ca),
        )
        self.usage.acting = self.acting
        self.recorder.acting = self.acting
        self.loads.acting = self.serving_fleet
        self.leadership = Leadership(
            self.store,
            holder_name(config.state_dir),
            config.lease_ttl,
            clock.monotonic,
            self.events,
        )
        self.watch = AssignmentWatch()
        self.catalog_file = CatalogFile(
            catalogs, self.calls, self.events, clock.time, config, self.acting, self.wake
        )
        self._beginning = False  # a term's store I/O under way: elected, not acting yet
        self.logs = LogRelay(self.watch)
        self.last_plan_s: float | None = None  # how long the last pass that planned took
        self.last_idle_pass_s: float | None = None  # and the last that did not
        self._told_no_routers = False  # warned that autoscaled models have no load to follow
        self._usage_totals: dict[str, tuple[int, int, float]] = {}  # as last read
        self.roster = Roster(self.calls, self.store, clock.monotonic)  # kept for the next term
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

    def standing_in(self) -> bool:
        """Whether it led until its store stopped answering, and nobody is known to lead
        since (`Leadership.standing_in`): it answers its agents, polls the routers' load,
        pushes tables and starts a model at zero where it ran last (`cold_start_once`),
        and changes nothing else."""
        return not self._beginning and self.leadership.standing_in()

    def serving_fleet(self) -> bool:
        """Whether it answers agents, polls the routers' load and pushes tables: while it
        acts, and while it stands in (`standing_in`)."""
        return self.acting() or self.standing_in()

    async def cold_start_once(self, now: float) -> None:
        """While standing in: a model at zero replicas whose requests a router holds starts
        one on the nodes it ran on last (`Term.cold_start`), counted in memory, stored when
        the store is back (`Autoscaler.record_stood_in`)."""
        loads = self.loads.loads(now)
        if loads is None or self.settling(now):
            return
        catalog = self.catalogs.current
        cold = [
            spec.name
            for spec in catalog.models
            if spec.autoscale is not None
            and spec.name in loads
            and loads[spec.name].held > 0
            and not self.state.of_model(spec.name)
        ]
        if not cold:
            return
        started = self.term.cold_start(catalog, cold, now)
        for model in started:
            self.autoscaler.stand_in(
                model,
                "requests held while the store is down: started on the node it ran on last; "
                "the count is stored when the store is back",
            )
        if started:
            self.notify_assignments()
            self.wake()

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
        self.autoscaler.record_stood_in()
        desired = self._read_desired()
        roster = read_roster(self.store)
        applied = self.catalogs.lead(self.clock.time())
        epoch = int(self.store.get_meta(ROUTING_EPOCH_KEY) or 0) + 1
        self.store.set_meta(ROUTING_EPOCH_KEY, str(epoch))
        return TermStart(desired, applied, epoch, roster)

    def _begin_term(self, start: TermStart) -> None:
        """A new term begins with this control plane leading, from what `_term_io` read, and
        from nothing else: what the term before learned is dropped. It settles (adopts what
        agents report before it plans) and publishes no table until nodes report."""
        self.term = self._new_term(self.leadership.leading_epoch, start)
        self.roster.began(start.roster)
        self._take_desired(start.desired, marks=True)
        if start.applied is not None:
            applied_event(self.events, start.applied, self.catalogs.current_info.source)
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
        self.autoscaler.unrecorded = {}  # another leads: its counts stand

    async def lease_loop(self) -> None:
        """Take or renew the lease every third of its TTL (a follower: as soon as the leader's
        runs out, if sooner); begin a term when elected."""
        while True:
            await asyncio.sleep(self.leadership.next_try_in())
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
            s.api_keys(),
            s.join_tokens(),
            s.credentials(),
            s.revoked_nodes(),
            s.marks(),
            self.autoscaler.stored(),
        )

    def _take_desired(self, desired: Desired, marks: bool) -> None:
        """Hold what `_read_desired` read; with `marks`, the nodes' marks too (a term begins):
        marks persist, their deadlines moved onto the monotonic clock."""
        # In place: a key change that lands late keeps what it made in this book.
        self.keys.keys = {k.name: k for k in desired.keys}
        self.membership = Membership(
            self.calls, self.ca, desired.tokens, desired.credentials, desired.revoked
        )
        self.autoscaler.load(desired.autoscale)
        if not marks:
            return
        wall, mono = self.clock.time(), self.clock.monotonic()
        for m in desired.marks:
            deadline = None if m.drain_deadline is None else mono + (m.drain_deadline - wall)
            self.state.set_mark(m.node, NodeMark(Mark(m.mark), deadline))

    def _store_unsure(self) -> None:
        """A write's outcome was not known when it was answered, and may have landed since."""
        self._unsure = True
        self.wake()

    async def follow_store(self) -> None:
        """After a write whose outcome was not known (`_store_unsure`): what is desired read
        again, and what the store holds that this leader's memory lacks (a catalog, a key, a
        mark committed after its answer said it may have been) taken into it, told as
        events, and acted on (routers get the keys with the next table). Join tokens and
        credentials are left as they are: a join under way writes the store, then them.
        A follower does nothing: a term begins by reading the store."""
        if not self._unsure or self.calls.outage is not None:
            return
        self._unsure = False
        if not self.acting():
            return
        keys, catalog = dict(self.keys.keys), self.catalogs.current
        try:
            desired = await self.calls(self._read_desired)
        except StoreError:
            self._unsure = True
            return
        self.keys.keys = {k.name: k for k in desired.keys}
        why = "as the store holds it: a change whose answer said it may have been made"
        now = self.catalogs.current
        if now.version != catalog.version:
            applied_event(self.events, Applied(now, True, catalog), f"the store ({why})")
        for name in sorted(self.keys.keys.keys() | keys.keys()):
            before, after = keys.get(name), self.keys.keys.get(name)
            if before != after:
                reason = "KeyCreated" if before is None else "KeyUpdated" if after else "KeyRevoked"
                self.events.normal(reason, f"key/{name}", why)
        self._follow_marks(desired.marks, why)
        self.wake()

    def _follow_marks(self, stored: list[StoredMark], why: str) -> None:
        """The marks of the nodes that reported made what the store holds."""
        marks = {m.node: m for m in stored}
        wall, mono = self.clock.time(), self.clock.monotonic()
        for node in list(self.state.nodes):
            held = self.state.marks.get(node)
            was = held.mark if held is not None else Mark.NONE
            m = marks.get(node)
            want = Mark(m.mark) if m is not None else Mark.NONE
            if want is was or was is Mark.REVOKED:
                continue
            due = m.drain_deadline if m is not None else None
            self.state.set_mark(node, NodeMark(want, None if due is None else mono + due - wall))
            self.events.normal("NodeMarked", f"node/{node}", f"marked {want.value} ({why})")

    async def create_key(
        self, request: admin.KeyCreate, once: Once | None = None
    ) -> tuple[str, StoredKey]:
        """Make a client API key (KeyRefused if not): the key itself, shown this once, and
        what is stored of it. Every router takes it with its next routing table."""
        names = key_names(self.catalogs.current)

        def made(stored: StoredKey) -> None:
            self.events.normal("KeyCreated", f"key/{stored.name}", f"prefix {stored.prefix}")
            self.wake()

        return await self.keys.create(request, names, self.store_time(), once, made)

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
        if self.state.adapters.waiting():
            self.wake()

    def read_events(
        self, regarding: str | None = None, since: float = 0.0, after: int = 0, limit: int = 1000
    ) -> list[StoredEvent]:
        """The store's events (as `Store.events`) about `regarding` as `event_scope` reads
        it, with those noted so far written first: a reader sees what happened up to its read
        (store I/O: off the event loop)."""
        self.events.flush()
        return self.store.events(event_scope(regarding), since, after, limit)

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
            elif self.standing_in():
                await self.cold_start_once(self.clock.monotonic())

    async def reconcile_loop(self) -> None:
        while True:
            if not self.acting():  # a follower plans nothing
                if self.standing_in():  # what its agents report is told, and routed
                    self.publish()
                    self.notify_assignments()
                    self.record_news()
                await wait_set(self._wake, self.config.reconcile_interval)
                self._wake.clear()
                continue
            self._wake.clear()
            await self.follow_store()
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
            await self.term.node_news.clear_marks(self.calls)
            await self.roster.keep(self.term)
            await wait_set(self._wake, self.config.reconcile_interval)

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
