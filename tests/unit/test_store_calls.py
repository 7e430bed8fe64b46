"""Store calls off the event loop (`store/calls.py`), and events that wait for the store
(`controlplane/events.py`): what a control plane does while its store does not answer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from modelfleet.controlplane.events import EventLog
from modelfleet.store import OutcomeUnknown, StoreError, StoreUnreachable
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore


class Frozen:
    """A store frozen like a SIGSTOPped server: a call waits until it thaws."""

    where = "postgresql://db-1/modelfleet"

    def __init__(self) -> None:
        self.thawed = threading.Event()
        self.calls = 0

    def get_meta(self, key: str) -> str | None:
        self.calls += 1
        self.thawed.wait(30)
        return "value"

    def write_problem(self) -> str | None:
        return None


def test_a_store_that_does_not_answer_opens_an_outage_and_every_call_is_refused_at_once() -> None:
    store = Frozen()
    wall = [1000.0]
    calls = StoreCalls(store, 0.2, lambda: wall[0])  # type: ignore[arg-type]

    async def go() -> None:
        began = time.monotonic()
        with pytest.raises(StoreUnreachable, match=r"no answer within 0\.2s"):
            await calls(store.get_meta, "k")
        assert time.monotonic() - began < 1.0
        assert calls.outage is not None and calls.outage.since == 1000.0
        wall[0] += 20
        began = time.monotonic()
        with pytest.raises(StoreUnreachable) as refused:
            await calls(store.get_meta, "k")
        assert time.monotonic() - began < 0.05  # refused at once: not tried
        said = str(refused.value)
        assert "postgresql://db-1/modelfleet is unreachable since" in said and "(20s)" in said
        assert "nothing was changed" in said
        assert store.calls == 1
        problem = calls.problem()
        assert problem is not None and "unreachable since" in problem
        # A probe is tried during the outage, one at a time; the first that answers ends it.
        probing = asyncio.create_task(calls.probe(store.get_meta, "k"))
        await asyncio.sleep(0.05)
        with pytest.raises(StoreUnreachable):
            await calls.probe(store.get_meta, "k")  # one is under way already
        with pytest.raises(StoreUnreachable):
            await probing  # frozen still: no answer within the deadline
        store.thawed.set()  # the stuck call ends too: then the next probe goes through
        deadline = time.monotonic() + 5
        while True:
            try:
                assert await calls.probe(store.get_meta, "k") == "value"
                break
            except StoreUnreachable:
                assert time.monotonic() < deadline, "no probe went through once thawed"
                await asyncio.sleep(0.01)
        assert calls.outage is None and calls.problem() is None
        assert await calls(store.get_meta, "k") == "value"

    asyncio.run(go())
    calls.close()


def test_background_work_slower_than_the_deadline_is_waited_for_and_is_no_outage() -> None:
    # Events written while 10,000 agents report: the worker thread gets little time, and a
    # batch took seconds. Counted as an outage, it refused reports and lapsed the lease.
    store = Frozen()
    calls = StoreCalls(store, 0.1)  # type: ignore[arg-type]

    async def go() -> None:
        slow = asyncio.create_task(calls.background(store.get_meta, "k"))
        await asyncio.sleep(0.3)  # three deadlines
        assert not slow.done() and calls.outage is None
        assert await calls(lambda: "other") == "other"  # other calls go on meanwhile
        store.thawed.set()
        assert await asyncio.wait_for(slow, 5) == "value"
        assert calls.outage is None
        store.thawed.clear()
        with pytest.raises(StoreUnreachable):
            await calls(store.get_meta, "k")  # a bounded call still opens the outage
        with pytest.raises(StoreUnreachable, match="unreachable since"):
            await calls.background(store.get_meta, "k")  # and background work waits it out
        store.thawed.set()

    asyncio.run(go())
    calls.close()


def test_a_refusal_by_a_store_that_answers_is_no_outage() -> None:
    class Full:
        where = "store.sqlite"

        def set_meta(self, key: str, value: str) -> None:
            raise StoreError("cannot write the store store.sqlite: database or disk is full")

    calls = StoreCalls(Full(), 1.0)  # type: ignore[arg-type]

    async def go() -> None:
        with pytest.raises(StoreError, match="disk is full"):
            await calls(Full().set_meta, "k", "v")
        assert calls.outage is None

    asyncio.run(go())


def test_events_noted_while_the_store_cannot_write_are_written_in_order_once_it_can() -> None:
    store = SqliteStore(":memory:")
    clock = iter(range(100, 200))
    log = EventLog(store, lambda: float(next(clock)))
    db = store._db
    db.execute("PRAGMA query_only = ON")  # every write fails, as on a store gone read-only
    log.warning("PushMissed", "router/r1", "unreachable")
    log.warning("PushMissed", "router/r1", "unreachable")  # counted up, not written yet
    log.normal("NodeMarked", "node/a", "cordoned")
    log.flush()  # fails: nothing lost, nothing written
    db.execute("PRAGMA query_only = OFF")
    assert store.events() == []
    log.normal("NodeMarked", "node/b", "cordoned")
    log.flush()
    written = store.events()
    assert [(e.reason, e.regarding, e.count) for e in written] == [
        ("PushMissed", "router/r1", 2),
        ("NodeMarked", "node/a", 1),
        ("NodeMarked", "node/b", 1),
    ]
    log.warning("PushMissed", "router/r1", "unreachable")  # a third time: the row counts up
    log.flush()
    assert store.events("router/r1")[0].count == 3


def test_an_event_of_a_term_that_ended_is_dropped_and_the_next_ones_written() -> None:
    store = SqliteStore(":memory:")
    assert store.take_lease("cp-a", 30.0).epoch == 1
    store.fence(2)  # a term that is over: every fenced write is refused
    log = EventLog(store, time.time)
    log.normal("ReplicaPlaced", "replica/x", "placed")
    log.warning("LeadershipLost", "control-plane/a", "b leads now", fenced=False)
    log.flush()
    assert [e.reason for e in store.events()] == ["LeadershipLost"]


def test_a_change_with_no_answer_in_time_may_have_been_made_and_lands_late() -> None:
    """Issue 57: a write that timed out was answered "nothing was changed" and committed once
    the store woke. Now it is OutcomeUnknown, never "nothing was changed"; its request id is
    in flight (a second attempt is not sent to the store) until its thread ends; and when it
    lands, what follows from it is done then, on the event loop."""
    store = Frozen()
    calls = StoreCalls(store, 0.2, time.time)  # type: ignore[arg-type]
    landed: list[str | None] = []

    async def go() -> None:
        with pytest.raises(OutcomeUnknown) as unknown:
            await calls.change(lambda: store.get_meta("k"), "req-1", landed.append)
        assert "nothing was changed" not in str(unknown.value)
        assert "req-1" in calls.in_flight and landed == []
        calls.outage = None  # as a probe would: the store answers others again
        with pytest.raises(OutcomeUnknown, match="earlier attempt"):
            await calls.change(lambda: store.get_meta("k"), "req-1", landed.append)
        assert store.calls == 1  # the second attempt was not sent
        store.thawed.set()
        deadline = time.monotonic() + 5
        while not landed:
            assert time.monotonic() < deadline, "what follows the late write was never done"
            await asyncio.sleep(0.01)
        assert landed == ["value"] and "req-1" not in calls.in_flight

    asyncio.run(go())
    calls.close()


def test_any_call_with_no_answer_in_time_is_of_unknown_outcome_and_read_again_if_it_ends() -> None:
    """A store call made otherwise (a node forgotten) that times out is OutcomeUnknown too,
    and if it ends well after all, `unsure` says so: the control plane reads the store
    again."""
    store = Frozen()
    calls = StoreCalls(store, 0.2, time.time)  # type: ignore[arg-type]
    unsure: list[bool] = []
    calls.unsure = lambda: unsure.append(True)

    async def go() -> None:
        with pytest.raises(OutcomeUnknown):
            await calls(store.get_meta, "k")
        assert unsure == []
        store.thawed.set()
        deadline = time.monotonic() + 5
        while not unsure:
            assert time.monotonic() < deadline, "a call that ended late was not said"
            await asyncio.sleep(0.01)

    asyncio.run(go())
    calls.close()
