"""Which of the control planes on one store leads: the lease in the store (`Store.take_lease`).

Every control plane tries to take the lease at start and every `ttl / RENEWALS` seconds
after; the one that holds it leads. Only the leader reconciles, places, starts and stops,
pushes routing tables, applies catalogs and collects usage; a follower does none of that,
serves reads from the store, and redirects agents and writes to the leader (307; 503 naming
it while it has not said where it is reached).

The lease runs out by the store's clock `ttl` after its last renewal. A leader acts only
until `ACT_SHARE * ttl` after it *asked* for that renewal (by its own monotonic clock, which
only has to run at the store's rate, not agree with it): it stops acting before the lease can
run out and another take it. Its writes are fenced besides (`Store.fence`): one that lands
after another leader took the lease is refused. What it sends agents carries the lease's
epoch, and agents refuse an epoch lower than one they have seen; routers order tables by a
routing epoch that only a leader's fenced write can raise (`ControlPlane._elected`).

A holder name is its state dir's (`holder_name`), so the lease also names the process that
holds it (`Process`: host, pid, boot). A control plane that finds its own name held by another
process refuses to lead while that one may live (a copied state dir, a cloned machine: two
processes with one instance id once both led under one epoch) and says why; one whose process
is known to have exited (the same host and boot, its pid gone) is a restart, and its lease is
taken back at once under the same epoch.

At every renewal each control plane also says where it is reached (`Store.see_control_plane`),
so a follower can redirect agents and operators to the leader (307), and `ctl status` can list
every control plane with when it was last seen.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from modelfleet.controlplane.events import EventLog
from modelfleet.host.statedir import instance_id
from modelfleet.store import Lease, SeenControlPlane, Store, StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")

RENEWALS = 3  # per TTL
ACT_SHARE = 5 / 6  # of the TTL after asking for a renewal, the leader may act
# A follower tries to take the lease this long after it runs out (by its own clock, from when
# it read how long the lease had left), and never sooner than SOONEST_S after a try.
AFTER_EXPIRY_S = 0.05
SOONEST_S = 0.05


def holder_name(state_dir: Path) -> str:
    """This control plane's name in the lease: its host, its state dir, and the state dir's
    random instance id. The same after a restart (one process per state dir: its lock), so a
    restarted leader takes its own lease back at once, under the same epoch; never the same
    for two state dirs, so two machines of one host name with the same state dir path (cloned
    machines) never hold one epoch together."""
    return f"{socket.gethostname()}:{os.path.abspath(state_dir)}:{instance_id(state_dir)}"


@dataclass(frozen=True)
class Process:
    """A running process, as the lease names its holder's: its host, its pid, and its host's
    boot (the kernel's boot id and the pid namespace: a pid means that process only there)."""

    host: str
    pid: int
    boot: str

    def text(self) -> str:
        return json.dumps([self.host, self.pid, self.boot])

    @classmethod
    def of(cls, text: str) -> Process | None:
        """The process `text` names; None for one this modelfleet cannot read."""
        try:
            host, pid, boot = json.loads(text)
            return cls(str(host), int(pid), str(boot))
        except (ValueError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"


def this_process() -> Process:
    """This process, as the lease names it."""
    boot = ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        boot += f"/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        pass
    return Process(socket.gethostname(), os.getpid(), boot)


def exited(other: Process, me: Process) -> bool:
    """Whether `other` is known to have exited: on this host since its boot, in this pid
    namespace, and its pid runs no more (or only as a zombie). Of another host (or boot) it is
    never known: its lease must run out."""
    if (other.host, other.boot) != (me.host, me.boot) or not me.boot:
        return False
    try:
        return psutil.Process(other.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


@dataclass(frozen=True)
class Exchange:
    """What one renewal read from the store."""

    before: Lease | None  # the lease before the take, when this one did not lead
    lease: Lease  # after it (the lease as it was, when this one refused to take it)
    planes: list[SeenControlPlane]


class Turn(enum.Enum):
    """What a renewal found."""

    ELECTED = "elected"  # a new term begins with this one leading: begin it
    LEADING = "leading"  # the term goes on
    LOST = "lost"  # another took the lease: the term this one led is over
    FOLLOWING = "following"
    UNKNOWN = "unknown"  # the store did not answer: acting stops when the lease runs out


class Leadership:
    """The lease as this control plane sees it, and whether it may act now.

    A renewal is store I/O (`exchange`, run off the event loop by `renew`) and then a
    decision in memory (`take`). A new term is begun by the control plane (`Turn.ELECTED`);
    one that cannot begin is given up (`abandon`) and begun again at the next renewal.
    """

    def __init__(
        self,
        store: Store,
        holder: str,
        ttl: float,
        monotonic: Callable[[], float],
        events: EventLog | None = None,
        process: Process | None = None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.process = process or this_process()
        self._process = self.process.text()
        # Why this one refuses to lead, while another process holds the lease under its name.
        self.refused = ""
        self.ttl = ttl
        self.monotonic = monotonic
        self.events = events
        self.epoch = 0  # of the lease, as last seen
        self.leader = ""  # who holds it, as last seen
        self.leading_epoch: int | None = None  # the epoch of the term this one leads, if any
        self.led_epoch: int | None = None  # the epoch this run of it last led under, if any
        self.problem = ""  # why the last renewal failed, while it does
        self.took_over = False  # the term this one leads began when another's lease ran out
        # Where this one is reached (agent API, admin API), once it listens: said to the store
        # at every renewal, so that followers can send agents and operators to the leader.
        self.urls: tuple[str, str] | None = None
        self.planes: list[SeenControlPlane] = []  # every control plane on the store, as read
        self.planes_read_at = monotonic()  # when
        self._act_until = -math.inf
        self._store_clock: tuple[float, float] | None = None  # the store's time, when read
        # Another's lease, as last read: (seconds it had left, when the read had come back).
        self._others: tuple[float, float] | None = None

    @property
    def interval(self) -> float:
        return self.ttl / RENEWALS

    def next_try_in(self) -> float:
        """Seconds until the next renewal: a third of the TTL; for a follower that read
        another's lease, just after that lease runs out if sooner. Tried only every third of
        the TTL, a lease killed with its leader was taken up to a third of a TTL after it ran
        out (kill -9 of the leader to another's first pass: 3.0-4.2 s at a TTL of 3 s)."""
        if self._others is None or self.problem:
            return self.interval
        left, read = self._others
        ends_in = left - (self.monotonic() - read) + AFTER_EXPIRY_S
        return min(self.interval, max(SOONEST_S, ends_in))

    def acting(self) -> bool:
        """Whether this control plane leads now and may act."""
        return self.monotonic() < self._act_until

    def lapsed(self) -> str | None:
        """Why this one may not act though the lease, as last read, is its own (its renewal
        came late: the store slow or the process starved); None when it is another's or it
        acts. It follows nobody meanwhile, and acts again at its next renewal."""
        if self.acting() or not self.leader or self.leader != self.holder:
            return None
        late = self.problem or "its renewal came too late"
        return f"this control plane holds the lease but may not act until it renews it ({late})"

    def standing_in(self) -> bool:
        """Whether this one led until its store stopped answering: it holds no lease it can
        renew, so it does not act, but nobody is known to have taken the lease from it (a
        renewal failed, none has found another holder). It may start a cold model where it
        ran last (`ControlPlane.cold_start_once`) and answer its agents meanwhile."""
        return self.leading_epoch is not None and bool(self.problem) and not self.acting()

    def store_time(self) -> float | None:
        """The store's clock now, as the last renewal read it and the monotonic clock moved
        on since (off by that renewal's round trip at most); None before any renewal."""
        if self._store_clock is None:
            return None
        read, asked = self._store_clock
        return read + (self.monotonic() - asked)

    def leader_url(self, api: str) -> str | None:
        """Where the leader, as last seen, serves `api` ("agent" or "admin"); None when there
        is none, it is this one, or it never said where it is."""
        for plane in self.planes:
            if plane.name == self.leader and plane.name != self.holder:
                return plane.agent_url if api == "agent" else plane.admin_url
        return None

    async def say_where(self, agent_url: str, admin_url: str, calls: StoreCalls) -> None:
        """Where this one is reached, once it listens: said now and at every renewal (not
        while it refuses to lead: its name is another process's too)."""
        self.urls = (agent_url, admin_url)
        if self.refused:
            return
        asked = self.monotonic()

        def say() -> list[SeenControlPlane]:
            self.store.see_control_plane(self.holder, agent_url, admin_url)
            return self.store.control_planes()

        try:
            self.planes, self.planes_read_at = await calls(say), asked
        except StoreError as exc:
            log.warning("cannot say where this control plane is reached (said again): %s", exc)

    def exchange(self) -> Exchange:
        """Take or renew the lease in the store, say where this one is reached, and read
        every control plane's. Store I/O only (a worker thread runs it); raises StoreError.
        The lease held under this one's name by another process that may live is left alone
        (and this one says nothing of where it is reached: the name is that one's too)."""
        before = self.store.lease() if self.leading_epoch is None else None
        replacing = self._replacing(before)
        if replacing is None:
            assert before is not None
            return Exchange(before, before, self.store.control_planes())
        lease = self.store.take_lease(self.holder, self.ttl, self._process, replacing)
        if self.urls is not None and lease.process == self._process:
            self.store.see_control_plane(self.holder, *self.urls)
        return Exchange(before, lease, self.store.control_planes())

    def _replacing(self, before: Lease | None) -> str | None:
        """Whom this one may replace in the lease under its own name: another process of it
        known to have exited (a restart: its lease, taken back at once), "" for nobody, and
        None while another process that may be alive holds it (the lease left alone)."""
        if before is None or before.holder != self.holder:
            return ""
        if before.process in ("", self._process):
            return ""
        other = Process.of(before.process)
        if other is not None and exited(other, self.process):
            return before.process
        return None if before.remaining_s > 0 else ""

    async def renew(self, calls: StoreCalls) -> Turn:
        """One renewal, its store I/O off the event loop (tried during a store outage too:
        it is what finds the store back)."""
        asked = self.monotonic()
        try:
            exchange = await calls.probe(self.exchange)
        except StoreError as exc:
            return self._failed(exc)
        return self.take(exchange, asked)

    def renew_now(self) -> Turn:
        """One renewal on this thread: at the start, before any event loop runs."""
        asked = self.monotonic()
        try:
            exchange = self.exchange()
        except StoreError as exc:
            return self._failed(exc)
        return self.take(exchange, asked)

    def _failed(self, exc: StoreError) -> Turn:
        if str(exc) != self.problem:
            log.warning("cannot renew the lease: %s; acting stops when it runs out", exc)
        self.problem = str(exc)
        return Turn.UNKNOWN

    def take(self, exchange: Exchange, asked: float) -> Turn:
        """What the renewal asked at monotonic time `asked` found."""
        lease, self.planes, self.planes_read_at = exchange.lease, exchange.planes, asked
        self._store_clock = (lease.store_now, asked)
        self.problem = ""
        self.leader, self.epoch = lease.holder, lease.epoch
        mine = lease.holder == self.holder and lease.process == self._process
        self._refuse(lease, mine)
        # The lease's time left was read before now: it runs out at most that long from now.
        self._others = (lease.remaining_s, self.monotonic()) if not mine else None
        if not mine:
            if self.leading_epoch is None:
                return Turn.FOLLOWING
            self.leading_epoch, self._act_until = None, -math.inf
            log.warning("lost the lease to %s (epoch %d): stopped acting", lease.holder,
                        lease.epoch)  # fmt: skip
            if self.events is not None:
                # Its own event, once it knows: the one write not fenced to the epoch it
                # lost (everything it may still have under way stays fenced).
                self.events.warning(
                    "LeadershipLost",
                    f"control-plane/{self.holder}",
                    f"{lease.holder} leads now, epoch {lease.epoch}",
                    fenced=False,
                )
            return Turn.LOST
        # It could not renew in time, by more than a TTL (frozen, or cut off from the store):
        # agents were turned away meanwhile, and its view of them is stale.
        lapsed = asked - self._act_until > self.ttl
        self._act_until = asked + ACT_SHARE * self.ttl
        if self.leading_epoch == lease.epoch and not lapsed:
            return Turn.LEADING
        why = _why_taken(exchange.before, self.holder, self._process, self.led_epoch, lease.epoch)
        if self.leading_epoch == lease.epoch:
            # Frozen, or cut off from the store, past what its lease let it do; nobody took
            # the lease meanwhile. What it saw before is stale (nodes seem long silent): a new
            # term begins, as after an election.
            why = "its own lease, renewed after its acting lapsed"
            log.warning("acting lapsed under epoch %d; a new term begins", lease.epoch)
        self.leading_epoch = self.led_epoch = lease.epoch
        self.store.fence(lease.epoch)
        before = exchange.before
        self.took_over = (
            before is not None
            and before.holder != ""
            and not _its_own(before, self.holder, self._process)
        )
        log.info("leading under epoch %d (%s)", lease.epoch, why)
        if self.events is not None:
            self.events.normal(
                "LeaderElected",
                f"control-plane/{self.holder}",
                f"leads under epoch {lease.epoch}: {why}",
            )
        return Turn.ELECTED

    def _refuse(self, lease: Lease, mine: bool) -> None:
        """Refuse to lead, and say why once, while another process holds the lease under
        this one's name."""
        if mine or lease.holder != self.holder:
            self.refused = ""
            return
        other = Process.of(lease.process)
        why = (
            f"refuses to lead: its holder name {self.holder} is held in the lease by another "
            f"live process ({other or lease.process}), not this one ({self.process}): a "
            "copied state dir or a cloned machine has its instance id; give each control "
            "plane a state dir of its own"
        )
        if why == self.refused:
            return
        self.refused = why
        log.error("this control plane %s", why)
        if self.events is not None:
            self.events.warning(
                "LeadershipRefused", f"control-plane/{self.holder}", why, fenced=False
            )

    def abandon(self, why: str) -> None:
        """The term just elected cannot begin (the store or the catalog file failed it): stop
        acting; the next renewal, finding the lease still this one's, begins it again."""
        log.warning("cannot begin the term of epoch %s: %s", self.leading_epoch, why)
        self.leading_epoch, self._act_until = None, -math.inf

    def release(self) -> None:
        """Let the lease run out now, if this one holds it (an orderly stop)."""
        if self.leading_epoch is None:
            return
        self._act_until = -math.inf
        self.leading_epoch = None
        try:
            self.store.release_lease(self.holder)
        except StoreError as exc:
            log.warning("cannot release the lease (it runs out by itself): %s", exc)


def _its_own(before: Lease, holder: str, process: str) -> bool:
    """Whether the lease read before the take was this one's: its own process's, or one of
    its name's that had exited (taken back at once: a restart)."""
    return before.holder == holder and (before.process in ("", process) or before.remaining_s > 0)


def _why_taken(before: Lease | None, holder: str, process: str, led: int | None, epoch: int) -> str:
    """Why `holder` (this `process`) leads under `epoch`: `before` is the lease as read before
    the take (None when it took it thinking it still led), `led` the epoch this run of it last
    led under."""
    if led is not None and (before is None or _its_own(before, holder, process)):
        others = epoch - led - 1
        if others <= 0:
            return f"its own lease of epoch {led}, taken again"
        return (
            f"its lease of epoch {led} ran out before it renewed it (frozen, or cut off from "
            f"the store); {others} other term(s) since"
        )
    if before is None or (before.holder == "" and before.epoch == 0):
        return "the first to lead on this store"
    if before.holder == "":
        return "the lease was let go by the one that held it (an orderly stop)"
    if _its_own(before, holder, process):
        return "its own lease, taken again after a restart"
    if before.holder == holder:
        other = Process.of(before.process)
        return f"the lease of another process under its name ({other}) ran out"
    return f"the lease of {before.holder} ran out"
