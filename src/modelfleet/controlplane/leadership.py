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

At every renewal each control plane also says where it is reached (`Store.see_control_plane`),
so a follower can redirect agents and operators to the leader (307), and `ctl status` can list
every control plane with when it was last seen.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path

from modelfleet.controlplane.events import EventLog
from modelfleet.statedir import instance_id
from modelfleet.store import Lease, SeenControlPlane, Store, StoreError

log = logging.getLogger("modelfleet.controlplane")

RENEWALS = 3  # per TTL
ACT_SHARE = 5 / 6  # of the TTL after asking for a renewal, the leader may act


def holder_name(state_dir: Path) -> str:
    """This control plane's name in the lease: its host, its state dir, and the state dir's
    random instance id. The same after a restart (one process per state dir: its lock), so a
    restarted leader takes its own lease back at once, under the same epoch; never the same
    for two state dirs, so two machines of one host name with the same state dir path (cloned
    machines) never hold one epoch together."""
    return f"{socket.gethostname()}:{os.path.abspath(state_dir)}:{instance_id(state_dir)}"


class Leadership:
    """The lease as this control plane sees it, and whether it may act now."""

    def __init__(
        self,
        store: Store,
        holder: str,
        ttl: float,
        monotonic: Callable[[], float],
        events: EventLog | None = None,
        on_elected: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.ttl = ttl
        self.monotonic = monotonic
        self.events = events
        self.on_elected = on_elected  # called with the epoch of each new term this one leads
        self.epoch = 0  # of the lease, as last seen
        self.leader = ""  # who holds it, as last seen
        self.leading_epoch: int | None = None  # the epoch of the term this one leads, if any
        self.problem = ""  # why the last renewal failed, while it does
        self.took_over = False  # the term this one leads began when another's lease ran out
        # Where this one is reached (agent API, admin API), once it listens: said to the store
        # at every renewal, so that followers can send agents and operators to the leader.
        self.urls: tuple[str, str] | None = None
        self.planes: list[SeenControlPlane] = []  # every control plane on the store, as read
        self._act_until = -math.inf

    @property
    def interval(self) -> float:
        return self.ttl / RENEWALS

    def acting(self) -> bool:
        """Whether this control plane leads now and may act."""
        return self.monotonic() < self._act_until

    def leader_url(self, api: str) -> str | None:
        """Where the leader, as last seen, serves `api` ("agent" or "admin"); None when there
        is none, it is this one, or it never said where it is."""
        for plane in self.planes:
            if plane.name == self.leader and plane.name != self.holder:
                return plane.agent_url if api == "agent" else plane.admin_url
        return None

    def say_where(self, agent_url: str, admin_url: str) -> None:
        """Where this one is reached, once it listens: said now and at every renewal."""
        self.urls = (agent_url, admin_url)
        try:
            self.store.see_control_plane(self.holder, agent_url, admin_url)
            self.planes = self.store.control_planes()
        except StoreError as exc:
            log.warning("cannot say where this control plane is reached (tried again): %s", exc)

    def renew(self) -> bool:
        """Take or renew the lease once; returns whether this control plane leads."""
        asked = self.monotonic()
        try:
            before = self.store.lease() if self.leading_epoch is None else None
            lease = self.store.take_lease(self.holder, self.ttl)
            if self.urls is not None:
                self.store.see_control_plane(self.holder, *self.urls)
            self.planes = self.store.control_planes()
        except StoreError as exc:
            if str(exc) != self.problem:
                log.warning("cannot renew the lease: %s; acting stops when it runs out", exc)
            self.problem = str(exc)
            return self.acting()
        self.problem = ""
        self.leader, self.epoch = lease.holder, lease.epoch
        if lease.holder != self.holder:
            if self.leading_epoch is not None:
                lost, self.leading_epoch = self.leading_epoch, None
                self._act_until = -math.inf
                log.warning("lost the lease to %s (epoch %d): stopped acting", lease.holder,
                            lease.epoch)  # fmt: skip
                if self.events is not None:
                    # Its own event, once it knows: the one write not fenced to the epoch it
                    # lost (everything it may still have under way stays fenced).
                    self.store.fence(None)
                    try:
                        self.events.warning(
                            "LeadershipLost",
                            f"control-plane/{self.holder}",
                            f"{lease.holder} leads now, epoch {lease.epoch}",
                        )
                    finally:
                        self.store.fence(lost)
            return False
        self._act_until = asked + ACT_SHARE * self.ttl
        if self.leading_epoch != lease.epoch:
            self.leading_epoch = lease.epoch
            self.store.fence(lease.epoch)
            why = _why_taken(before, self.holder)
            self.took_over = before is not None and before.holder not in ("", self.holder)
            log.info("leading under epoch %d (%s)", lease.epoch, why)
            if self.events is not None:
                self.events.normal(
                    "LeaderElected",
                    f"control-plane/{self.holder}",
                    f"leads under epoch {lease.epoch}: {why}",
                )
            if self.on_elected is not None:
                try:
                    self.on_elected(lease.epoch)
                except (StoreError, OSError) as exc:
                    # The term cannot begin (the store or the catalog file failed it): it is
                    # begun again at the next renewal, which finds the lease still its own.
                    log.warning("cannot begin the term of epoch %d: %s", lease.epoch, exc)
                    self.leading_epoch, self._act_until = None, -math.inf
                    return False
        return True

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


def _why_taken(before: Lease | None, holder: str) -> str:
    if before is None or before.holder == "":
        return "the first to lead on this store"
    if before.holder == holder:
        return "its own lease, taken again after a restart"
    return f"the lease of {before.holder} ran out"
