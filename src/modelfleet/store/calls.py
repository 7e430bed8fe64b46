"""Store calls made off the event loop, each bounded by a deadline, and the store's outages.

The stores are synchronous (one transaction per call). A control plane that called them on
its event loop stopped answering anything while its PostgreSQL did not answer: a query sent
to a frozen server waits as long as the server is frozen (its kernel still acknowledges what
is sent, so no TCP timeout ends it). `StoreCalls` runs each call in a worker thread and
waits for it no longer than its deadline. A call that does not answer in time, or fails to
reach the store, opens an *outage*: from then on calls are refused at once
(`StoreUnreachable`, naming the store and since when), so that nothing piles up behind a
store that is gone and every request is answered within its deadline. One call at a time may
still go through as a `probe` (the lease's renewal, every third of its TTL); the first that
succeeds ends the outage. Work nobody waits on (writing events) goes as `background`: waited
for however long it takes, as slowness under load is no outage. A refused call changed
nothing. A read that timed out changed nothing either; a write may still land later (a
PostgreSQL frozen for 2 s committed it once it woke), so an operator's change goes as a
`change`: one that does not answer in time is `OutcomeUnknown` ("may have been made", never
"nothing was changed"), its request id stays `in_flight` until its thread ends, and if it
lands then, what the change does besides the write (its event, the routers told) is done then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from modelfleet.store import OutcomeUnknown, Store, StoreError, StoreUnreachable

log = logging.getLogger("modelfleet.store")

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Outage:
    """The store unreachable: since when (wall-clock seconds) and why, as first seen."""

    since: float
    why: str


class StoreCalls:
    """Calls to `store`, each in a worker thread, waited for at most `deadline` seconds."""

    def __init__(
        self,
        store: Store,
        deadline: float,
        wall: Callable[[], float] = time.time,
        workers: int = 8,
    ) -> None:
        self.store = store
        self.deadline = deadline
        self.wall = wall
        self.outage: Outage | None = None
        self._pool = _DaemonPool(workers)
        self._probing: asyncio.Future[Any] | None = None
        # The changes whose outcome is not known yet, by request id: their threads still wait
        # on the store, and may yet commit.
        self.in_flight: dict[str, asyncio.Future[Any]] = {}
        # Called when a change's outcome stays unknown (the connection broke while it
        # committed): the control plane reads the store again to learn it.
        self.unsure: Callable[[], None] = lambda: None

    async def __call__(
        self,
        fn: Callable[P, T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """`fn(*args, **kwargs)`, run in a worker thread; StoreUnreachable at once during an
        outage, or when it does not answer within the deadline."""
        if self.outage is not None:
            raise StoreUnreachable(self.refusal())
        return await self._run(False, lambda: fn(*args, **kwargs))

    async def probe(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """As a call, but tried during an outage too (one at a time): its success ends it."""
        if self._probing is not None and not self._probing.done():
            raise StoreUnreachable(self.refusal() if self.outage else "a probe is under way")
        return await self._run(True, lambda: fn(*args, **kwargs))

    async def background(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """As a call, but waited for however long it takes: work nobody waits on (writing
        events). Its slowness is no outage: a control plane busy with 10,000 agents' reports
        gave a worker thread so little time that a batch of events took seconds, and each
        such batch, counted as an outage, refused the reports and lapsed the lease. A store
        that fails to answer it (StoreUnreachable) still opens one."""
        if self.outage is not None:
            raise StoreUnreachable(self.refusal())
        return await self._run(False, lambda: fn(*args, **kwargs), bounded=False)

    async def change(self, work: Callable[[], T], request: str, landed: Callable[[T], object]) -> T:
        """`work()`, a write made with the request id `request`, run as a call; but one that
        does not answer within the deadline raises OutcomeUnknown (it may still commit), and
        if it lands after all, `landed(its result)` is called on the event loop then. While
        an earlier attempt of the same request is in flight, OutcomeUnknown at once."""
        if self.outage is not None:
            raise StoreUnreachable(self.refusal())
        if request in self.in_flight:
            raise OutcomeUnknown(
                f"the store {self.store.where} has not answered an earlier attempt of this "
                "request yet"
            )
        return await self._run(False, work, late=(request, landed))

    async def _run(
        self,
        probing: bool,
        work: Callable[[], T],
        bounded: bool = True,
        late: tuple[str, Callable[[T], object]] | None = None,
    ) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.run_in_executor(self._pool, work)
        if probing:
            self._probing = future
        try:
            answer = await asyncio.wait_for(
                asyncio.shield(future), self.deadline if bounded else None
            )
        except TimeoutError:
            why = f"no answer within {self.deadline:.1f}s"
            self._down(why)
            if late is not None:
                self._follow(future, *late)
            else:  # a write that lands later is not known to the caller: the store is read again
                future.add_done_callback(self._landed_unknown)
            raise OutcomeUnknown(f"the store {self.store.where}: {why}") from None
        except OutcomeUnknown as exc:
            self._down(str(exc))
            self.unsure()
            raise
        except StoreUnreachable as exc:
            self._down(str(exc))
            raise
        except StoreError:
            # It answered: a refusal or a full disk is no outage. Not said of background work:
            # begun before an outage and stuck in it, its failure came as the server went
            # away, and ended the outage that had just begun.
            if bounded:
                self._up()
            raise
        self._up()
        return answer

    def _follow(
        self, future: asyncio.Future[T], request: str, landed: Callable[[T], object]
    ) -> None:
        """Keep `request` in flight until `future` (its write, past its deadline) ends; then
        `landed(result)` if it was made, `unsure()` if its outcome is still not known."""
        self.in_flight[request] = future

        def ended(done: asyncio.Future[T]) -> None:
            self.in_flight.pop(request, None)
            if done.cancelled():
                return
            failed = done.exception()
            if isinstance(failed, OutcomeUnknown):  # the store is read again to know
                log.warning("request %s: whether it was made is still not known: %s",
                            request, failed)  # fmt: skip
                self.unsure()
                return
            if failed is not None:
                log.warning(
                    "request %s, answered as it may have been made, was not: %s", request, failed
                )
                return
            log.warning("request %s landed in the store after its answer said it may", request)
            try:
                landed(done.result())
            except Exception:  # what it does besides the write is not to stop the loop
                log.exception("request %s landed, and what follows from it failed", request)

        future.add_done_callback(ended)

    def _landed_unknown(self, done: asyncio.Future[Any]) -> None:
        """A call past its deadline ended: if it succeeded, and it was a write, the store holds
        what its caller does not know of."""
        if not done.cancelled() and done.exception() is None:
            self.unsure()

    def refusal(self) -> str:
        """Why a call is refused during the outage."""
        assert self.outage is not None
        since = time.strftime("%H:%M:%S", time.localtime(self.outage.since))
        ago = max(0.0, self.wall() - self.outage.since)
        return (
            f"the store {self.store.where} is unreachable since {since} ({ago:.0f}s): "
            f"{self.outage.why}; nothing was changed, and it is tried again by itself"
        )

    def problem(self) -> str | None:
        """What is wrong with the store now, for `ctl status`: unreachable, or cannot write."""
        if self.outage is not None:
            return self.refusal()
        return self.store.write_problem()

    def _down(self, why: str) -> None:
        if self.outage is None:
            self.outage = Outage(self.wall(), why)
            log.warning("the store %s is unreachable: %s; retried by itself", self.store.where, why)

    def _up(self) -> None:
        if self.outage is not None:
            lasted = self.wall() - self.outage.since
            log.warning("the store %s answers again, after %.1fs", self.store.where, lasted)
            self.outage = None

    def close(self) -> None:
        """Stop the workers once they are done; a call still waiting on a frozen store is
        left behind (its thread does not hold up the process's exit)."""
        self._pool.close()


class _DaemonPool(concurrent.futures.Executor):
    """Worker threads that never hold up the process's exit: the standard pool joins its
    threads at exit, and one stuck in a call to a frozen store would hang a control plane's
    stop for as long as the store is frozen."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"store-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
