"""`ControlPlane`: the control plane's state and its loops, around `FleetState`, the
`CatalogKeeper` and the pure planner.

The reconcile loop runs every `reconcile_interval` seconds and at once after a report, a mark
or a catalog swap that changed something; each pass that changes the routing table is pushed
to every router (`publisher.py`). A replica taken out of service is stopped only after every
router has confirmed a table without it. The listeners (`agent_api.py`, `admin_api.py`) call
into it; `service.py` runs it all as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from modelfleet.catalog import Catalog
from modelfleet.clock import SYSTEM_CLOCK, Clock
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import (
    DEFAULT_SETTLE_FOR_S,
    ROUTING_EPOCH_KEY,
    ControlPlaneConfig,
)
from modelfleet.controlplane.keys import KeyBook
from modelfleet.controlplane.publisher import Publisher
from modelfleet.controlplane.state import FleetState, NodeMark
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.fleet import Mark
from modelfleet.reconcile import Preview, plan, preview, settling
from modelfleet.store import StoredMark

log = logging.getLogger("modelfleet.controlplane")


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
    ) -> None:
        self.config = config
        self.catalogs = catalogs
        self.clock = clock
        self.state = FleetState(stale_after=config.node_stale_after)
        self.started_at = clock.monotonic()
        self.settle_for = config.settle_for or DEFAULT_SETTLE_FOR_S
        self._wake = asyncio.Event()
        self._http = http or httpx.AsyncClient(timeout=5)
        self.store = catalogs.store
        self.keys = KeyBook(self.store)
        self.usage = UsageCollector(
            config.routers, self._http, self.store, config.usage_interval, clock.time
        )
        epoch = int(self.store.get_meta(ROUTING_EPOCH_KEY) or 0) + 1
        self.store.set_meta(ROUTING_EPOCH_KEY, str(epoch))
        self.publisher = Publisher(config.routers, self._http, epoch, config.push_interval)
        self._file_error = ""
        self.passes = 0  # reconcile passes that planned, for operators (and tests) to count
        self.frozen = ""  # the last pass's `Plan.frozen`: why nothing moves off lost nodes
        self._load_marks()

    def wake(self) -> None:
        """Run the next reconcile pass now: something it plans from has changed."""
        self._wake.set()

    # -- marks -----------------------------------------------------------------------------

    def _load_marks(self) -> None:
        """Marks persist: take them from the store, deadlines moved onto the monotonic clock."""
        wall, mono = self.clock.time(), self.clock.monotonic()
        for m in self.store.marks():
            deadline = None if m.drain_deadline is None else mono + (m.drain_deadline - wall)
            self.state.set_mark(m.node, NodeMark(Mark(m.mark), deadline))

    def set_mark(self, node: str, mark: Mark, grace: float) -> Mark:
        """Mark `node` (a drain bounded by `grace` seconds; 0: no bound), persist it, and
        return the mark it had."""
        was = self.state.marks.get(node)
        wall, mono = self.clock.time(), self.clock.monotonic()
        bounded = mark is Mark.DRAINING and grace > 0
        if mark is Mark.NONE:
            self.store.clear_mark(node)
        else:
            self.store.set_mark(
                StoredMark(node, mark.value, wall, wall + grace if bounded else None)
            )
        self.state.set_mark(node, NodeMark(mark, mono + grace if bounded else None))
        self.wake()
        previous = was.mark if was else Mark.NONE
        log.info("node %s marked %s (was %s)", node, mark.value, previous.value)
        return previous

    def delete_node(self, node: str, force: bool) -> list[str]:
        """Forget `node`. Refused (NodeBusy) while replicas run on it, unless `force`: then
        they are taken out of service at once and placed anew elsewhere. Returns their ids."""
        held = self.state.holding(node)
        if held and not force:
            raise NodeBusy(node, held)
        self.state.retire(held, f"node {node} deleted by an operator", self.clock.monotonic())
        self.state.forget(node)
        self.store.clear_mark(node)
        self.wake()
        log.info(
            "node %s deleted%s", node, f"; replicas retired: {', '.join(held)}" if held else ""
        )
        return held

    def forget_silent(self, now: float) -> None:
        """Forget nodes silent for `node_forget_after` that hold no replica."""
        for name, record in list(self.state.nodes.items()):
            silent = now - record.received
            if silent > self.config.node_forget_after and not self.state.holding(name):
                log.info(
                    "node %s forgotten: no report for %.0fs and no replica on it", name, silent
                )
                self.state.forget(name)
                self.store.clear_mark(name)

    async def preview(self, catalog: Catalog) -> Preview:
        """What the next passes would start and stop to make `catalog` true.

        A preview plans up to hundreds of passes: it runs in a worker thread, on a copy of
        what it reads (the table and the nodes are immutable values), so agents' reports and
        the reconcile loop go on meanwhile.
        """
        s = self.state
        args = (catalog, s.planned(), s.node_list(), s.busy_slots(), self.clock.monotonic())

        def work() -> Preview:
            done = preview(*args, s.stale_after)
            for pending in done.pending:
                _ = pending.explanation  # worked out here, not when the answer is built
            return done

        return await asyncio.to_thread(work)

    # -- reconcile and publish -----------------------------------------------------------

    def settling(self, now: float) -> bool:
        return settling(
            now,
            self.started_at,
            self.settle_for,
            self.config.known_nodes,
            self.state.nodes.keys(),
        )

    def reconcile_once(self, now: float) -> None:
        """One pass: plan against what is known, carry the plan out (unless settling)."""
        if self.settling(now):
            return
        self.passes += 1
        self.forget_silent(now)
        s = self.state
        catalog = self.catalogs.current
        failed = {}
        for rid, (node, why) in s.failing(self.config.max_failures).items():
            s.keep_off(s.replicas[rid].replica.model, node, why, now + self.config.failure_avoid)
            failed[rid] = why
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
            self.config.node_lost_after,
        )
        if decided.frozen != self.frozen:
            if decided.frozen:
                log.warning("%s", decided.frozen)
            else:
                log.info("nodes report again: lost nodes are handled as usual")
            self.frozen = decided.frozen
        for stop in decided.stop:
            log.info("retiring replica %s: %s", stop.replica_id, stop.reason)
        before = s.pending
        for replica in s.apply(decided, catalog, now, self.config.retire_timeout):
            where = ", ".join(f"{p.node}{list(p.gpus)}" for p in replica.shards)
            log.info("placed %s (%s) on %s", replica.id, replica.model, where)
        # Pending replicas are logged when they change, not on every pass.
        was = {p.model: p.count for p in before}
        for p in decided.pending:
            if was.get(p.model) != p.count:
                log.info("%d replica(s) of %s pending: %s", p.count, p.model, p.explanation.summary)

    def release_retired(self, now: float) -> None:
        """Let go of the retiring replicas every router has stopped routing to."""
        for rid, why in self.state.release(self.publisher.routed_version(), now):
            log.info("replica %s is out of every routing table; stopping it (%s)", rid, why)

    def publish(self) -> None:
        """Publish the routing table; the publisher's tasks push it to the routers.

        Nothing is published while settling: the table is still empty of what agents have yet
        to report, and a router keeps serving from the one it holds.
        """
        if self.settling(self.clock.monotonic()):
            return
        catalog = self.catalogs.current
        self.publisher.publish(
            catalog.version, self.state.routing_models(catalog), self.keys.routed()
        )
        self.state.mark_unrouted(self.publisher.version)

    async def reconcile_loop(self) -> None:
        while True:
            self._wake.clear()
            self.reconcile_once(self.clock.monotonic())
            self.publish()
            self.release_retired(self.clock.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval)

    async def catalog_loop(self) -> None:
        """Apply the catalog file whenever its content changes."""
        while True:
            await asyncio.sleep(self.config.catalog_poll_interval)
            try:
                applied = self.catalogs.check_file(self.clock.time())
                self._file_error = ""
            except OSError as exc:
                if str(exc) != self._file_error:  # once per distinct error, not every poll
                    self._file_error = str(exc)
                    log.warning("cannot read the catalog file: %s; the current one stays", exc)
                continue
            if applied is not None and applied.changed:
                self.wake()

    async def close(self) -> None:
        await self._http.aclose()
        self.catalogs.store.close()
