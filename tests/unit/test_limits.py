"""Per-key limits: the minute's arithmetic, and the same behaviour whether the counters live in
one router's memory or in a real Redis server shared by routers; leases, slots that outlive
their router, a Redis that restarts or hangs, routers whose clocks differ."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from modelfleet.core.token_bound import token_bound
from modelfleet.messages.wire import RoutedModel
from modelfleet.router.limits import (
    LEASE_SHARE,
    SLICE,
    SLOT_TTL,
    WINDOW,
    Limits,
    MemoryLimits,
    RedisLimits,
    Refusal,
    Ticket,
    leased,
)
from modelfleet.router.limits.window import check, slice_of
from modelfleet.router.table import ApiKey
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator

from ..redis_kit import RedisServer, redis_server, running_redis
from .router_kit import FakeClock, client_of, keyed, run, serving, until

T0 = 1000 * WINDOW + 10.0  # 10 s into a minute


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


Backends = Callable[[], Awaitable[list[Limits]]]


def _routers(url: str, n: int, prefix: str | None = None, **options: object) -> list[RedisLimits]:
    """`n` routers' limits on one Redis server, with counts of their own (`prefix`), on the
    times the test passes (no clock of Redis' unless `sync_clock=True`)."""
    prefix = prefix or f"test:{uuid.uuid4().hex}:"
    made = []
    for _ in range(n):
        limits = RedisLimits.from_url(url, sync_clock=bool(options.pop("sync_clock", False)))
        for name, value in options.items():
            setattr(limits, name, value)
        limits.prefix = prefix
        made.append(limits)
    return made


@pytest.fixture(params=["memory", "redis"])
def backends(request: pytest.FixtureRequest) -> Backends:
    """Two routers' limits: with memory, one router's (the only case where it is right);
    with Redis, two clients of one server, as two routers have."""

    async def make() -> list[Limits]:
        if request.param == "memory":
            one = MemoryLimits()
            return [one, one]
        return list(_routers(request.getfixturevalue("redis_url"), 2))

    return make


def test_requests_per_minute_are_exact_and_retry_after_says_when_one_fits(
    backends: Backends,
) -> None:
    key = ApiKey("k", "h", rpm=3)

    async def go() -> None:
        a, b = await backends()
        at = [T0, T0 + 10, T0 + 20]
        admitted = [await (a, b)[i % 2].admit(key, 0, "same-id", t) for i, t in enumerate(at)]
        assert all(isinstance(t, Ticket) for t in admitted)  # a reused x-request-id counts too
        refused = await b.admit(key, 0, "r3", T0 + 30)
        assert isinstance(refused, Refusal) and refused.limit == "rpm"
        assert refused.retry_after == pytest.approx(30.0)  # when the first is a minute old
        assert isinstance(await a.admit(key, 0, "r4", T0 + 59.9), Refusal)
        assert isinstance(await a.admit(key, 0, "r5", T0 + 60.01), Ticket)
        again = await b.admit(key, 0, "r6", T0 + 60.02)
        assert isinstance(again, Refusal)
        assert again.retry_after == pytest.approx(10 - 0.02)  # the second's turn
        assert isinstance(await b.admit(ApiKey("other", "h", rpm=3), 0, "x", T0), Ticket)

    run(go())


def test_admissions_at_once_are_counted_exactly(backends: Backends) -> None:
    """Concurrent admissions (in Redis they go together, one pipeline): exactly the limit."""
    key = ApiKey("k", "h", rpm=5)

    async def go() -> None:
        a, b = await backends()
        got = await asyncio.gather(
            *((a, b)[i % 2].admit(key, 0, f"r{i}", T0 + i / 100) for i in range(12))
        )
        assert sum(isinstance(g, Ticket) for g in got) == 5
        assert all(g.limit == "rpm" for g in got if isinstance(g, Refusal))

    run(go())


def test_a_token_reservation_holds_until_the_real_usage_settles_it(backends: Backends) -> None:
    key = ApiKey("k", "h", tpm=1000)

    async def go() -> None:
        a, b = await backends()
        first = await a.admit(key, 400, "r1", T0)
        second = await b.admit(key, 400, "r2", T0)
        assert isinstance(first, Ticket) and isinstance(second, Ticket)
        third = await a.admit(key, 400, "r3", T0)  # 1,200 reserved would overshoot
        assert isinstance(third, Refusal) and third.limit == "tpm"
        await a.settle(second, None, T0)  # usage unknown: the reservation stands
        assert isinstance(await a.admit(key, 400, "r3", T0), Refusal)
        await b.settle(first, 50, T0)  # it used 50: 350 given back
        assert isinstance(await a.admit(key, 400, "r3", T0), Ticket)
        never = await a.admit(key, 5000, "r4", T0 + 1)
        assert isinstance(never, Refusal) and "lower max_tokens" in never.message("k", 5000)

    run(go())


def test_tokens_used_beyond_the_reservation_count_when_they_are_found(
    backends: Backends,
) -> None:
    """Counted where they were reserved they would leave the window early: they count from
    the end of the request on, a full minute."""
    key = ApiKey("k", "h", tpm=1000)

    async def go() -> None:
        a, _ = await backends()
        ticket = await a.admit(key, 100, "r", T0)
        assert isinstance(ticket, Ticket)
        await a.settle(ticket, 900, T0 + 50)  # 800 more than reserved, found at T0 + 50
        refused = await a.admit(key, 250, "r2", T0 + WINDOW + 5)  # the first slice has left
        assert isinstance(refused, Refusal) and refused.limit == "tpm"
        assert isinstance(await a.admit(key, 250, "r3", T0 + 50 + WINDOW + SLICE), Ticket)

    run(go())


def test_requests_in_flight_are_counted_across_routers_until_they_end(backends: Backends) -> None:
    key = ApiKey("k", "h", max_concurrent=2)

    async def go() -> None:
        a, b = await backends()
        one, two = await a.admit(key, 0, "r1", T0), await b.admit(key, 0, "r2", T0)
        assert isinstance(one, Ticket) and isinstance(two, Ticket)
        third = await a.admit(key, 0, "r3", T0)
        assert isinstance(third, Refusal) and third.limit == "max_concurrent"
        assert "2 requests at once" in third.message("k", 0)
        await b.settle(one, 10, T0 + 1)
        assert isinstance(await b.admit(key, 0, "r3", T0 + 1), Ticket)

    run(go())


def test_a_small_rate_and_a_concurrency_limit_hold_together(backends: Backends) -> None:
    """An off-by-one in the concurrency check of the per-request script survived every
    test: none paired a small rate limit with max_concurrent."""
    key = ApiKey("k", "h", rpm=60, tpm=10_000, max_concurrent=2)

    async def go() -> None:
        a, b = await backends()
        held = [await a.admit(key, 10, "r1", T0), await b.admit(key, 10, "r2", T0 + 1)]
        assert all(isinstance(t, Ticket) for t in held)
        refused = await a.admit(key, 10, "r3", T0 + 2)
        assert isinstance(refused, Refusal) and refused.limit == "max_concurrent"
        ticket = held[0]
        assert isinstance(ticket, Ticket)
        await b.settle(ticket, 10, T0 + 3)
        assert isinstance(await a.admit(key, 10, "r4", T0 + 4), Ticket)
        refused = await b.admit(key, 10, "r5", T0 + 5)
        assert isinstance(refused, Refusal) and refused.limit == "max_concurrent"

    run(go())


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 300),
    gaps=st.lists(st.floats(0, 20), min_size=1, max_size=200),
    costs=st.lists(st.integers(1, 60), min_size=1, max_size=200),
    used=st.lists(st.integers(0, 80), min_size=1, max_size=200),
)
def test_no_60_s_window_holds_more_tokens_than_the_limit(
    limit: int, gaps: list[float], costs: list[int], used: list[int]
) -> None:
    """Requests at any times, each settled at once to what it used: in any 60 s, the tokens
    used never exceed the limit (the two-bucket estimate let nearly twice through)."""
    memory = MemoryLimits()
    key = ApiKey("k", "h", tpm=limit)
    now = T0
    spent: list[tuple[float, int]] = []
    for i, gap in enumerate(gaps):
        now += gap
        cost = costs[i % len(costs)]
        ticket = memory.admit_at_once(key, cost, "r", now)
        if isinstance(ticket, Ticket):
            tokens = min(used[i % len(used)], cost)  # what the engine reported, at most asked
            memory.settle_at_once(ticket, tokens, now)
            spent.append((now, tokens))
    for end, _ in spent:
        assert sum(n for t, n in spent if end - WINDOW < t <= end) <= limit


@given(
    times=st.lists(st.floats(-59.9, 0), max_size=30),
    requests=st.dictionaries(st.integers(-32, 0), st.integers(1, 50), max_size=10),
    tokens=st.dictionaries(st.integers(-32, 0), st.integers(1, 500), max_size=10),
    rpm=st.integers(1, 200),
    tpm=st.integers(1, 3000),
    cost=st.integers(1, 400),
    into=st.floats(0, SLICE - 0.001),
)
def test_after_retry_after_the_request_fits_and_not_much_before(
    times: list[float],
    requests: dict[int, int],
    tokens: dict[int, int],
    rpm: int,
    tpm: int,
    cost: int,
    into: float,
) -> None:
    now = 5000 * SLICE + into
    here = slice_of(now)
    key = ApiKey("k", "h", rpm=rpm, tpm=tpm)
    at = [now + t for t in times]
    by_slice = {here + s: n for s, n in requests.items()}
    by_slice_t = {here + s: n for s, n in tokens.items()}
    refusal = check(key, at, by_slice, by_slice_t, 0, cost, now)
    if refusal is None or cost > tpm:  # never fits: the refusal says to ask for less
        return
    wait = refusal.retry_after
    assert check(key, at, by_slice, by_slice_t, 0, cost, now + wait + 1e-6) is None
    if wait > 0.01:
        assert check(key, at, by_slice, by_slice_t, 0, cost, now + wait - 0.01) is not None


def test_an_unreachable_store_lets_requests_through_or_refuses_them_as_configured(
    tmp_path: Path,
) -> None:
    key = ApiKey("k", "h", rpm=1)
    with redis_server(tmp_path) as url:
        pass  # stopped: nothing listens at url any more

    async def go() -> None:
        open_ = RedisLimits.from_url(url, fail_open=True)
        for i in range(3):
            ticket = await open_.admit(key, 0, f"r{i}", T0)
            assert isinstance(ticket, Ticket) and not ticket.backed
            await open_.settle(ticket, 5, T0)
        closed = RedisLimits.from_url(url, fail_open=False)
        refused = await closed.admit(key, 0, "r", T0)
        assert isinstance(refused, Refusal) and refused.limit == "store"
        at_once = await asyncio.gather(*(closed.admit(key, 0, f"r{i}", T0) for i in range(4)))
        assert all(isinstance(r, Refusal) and r.limit == "store" for r in at_once)
        assert (open_.store_failures, closed.store_failures) == (3, 5)
        await open_.close()
        await closed.close()

    run(go())


def test_a_router_whose_limits_store_is_down_refuses_limited_keys_with_503_naming_why(
    tmp_path: Path,
) -> None:
    """With two routers failing open, a key of rpm 100 was served 220 requests in a minute
    while Redis answered slowly. By default a router now fails closed: a key with limits
    gets 503 saying why, a key without limits is served as ever."""
    with redis_server(tmp_path) as url:
        pass  # stopped: nothing listens at url any more

    async def go() -> None:
        sim = create_simulator(SimSettings(model="m", ttft=0, itl=0))
        async with serving(sim) as engine:
            router = keyed(
                models=[RoutedModel(name="m", endpoints=[engine])],
                api_keys=[
                    {"name": "alice", "key": "alice-key", "rpm": 100},
                    {"name": "bob", "key": "bob-key"},
                ],
                limits_store=url,
            )
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            async with client_of(router) as c:
                answer = await c.post(
                    "/v1/completions", json=body, headers={"authorization": "Bearer alice-key"}
                )
                assert answer.status_code == 503
                message = answer.json()["error"]["message"]
                assert "limits store does not answer" in message and "alice" in message
                assert "ConnectionError" in message  # what the store did
                assert answer.headers["retry-after"] == "1"
                served = await c.post(
                    "/v1/completions", json=body, headers={"authorization": "Bearer bob-key"}
                )
                assert served.status_code == 200
            await router.close()

    run(go())


def _held(limits: RedisLimits) -> asyncio.Event:
    """Hold every round trip of `limits` to its store until the returned event is set: a
    store that answers slowly."""
    gate = asyncio.Event()
    real = limits.store.call

    async def call(work: Callable[[], Awaitable[object]]) -> object:
        await gate.wait()
        return await real(work)

    limits.store.call = call  # type: ignore[method-assign]
    return gate


@pytest.mark.parametrize("rpm", [100, 1_000], ids=["exact", "leased"])
def test_a_client_that_leaves_while_its_admission_waits_for_the_store_frees_its_slot(
    redis_url: str, rpm: int
) -> None:
    """A client that left while its router waited for Redis held its key's slot for 30 s (an
    exact key: until the slot's deadline) or a minute (a leased key: until the lease went
    idle). The store's answer for it now gives the slot back at once."""

    async def go() -> None:
        a, b = _routers(redis_url, 2)
        key = ApiKey("k", "h", rpm=rpm, max_concurrent=1)
        gate = _held(a)
        asking = asyncio.ensure_future(a.admit(key, 0, "r1", T0))
        sent = (
            (lambda: getattr(a.leases._leases.get("k"), "fetching", None) is not None)
            if rpm >= 1_000
            else (lambda: not a.exact._admitting and a.exact._admit_flusher is not None)
        )
        await until("the admission on its way to the store", sent)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        gate.set()  # the store answers: admitted, for a client that is gone

        async def slot_free() -> bool:
            got = await b.admit(key, 0, "r2", T0 + 1)
            if isinstance(got, Ticket):
                return True
            assert got.limit == "max_concurrent"
            await asyncio.sleep(0.02)
            return False

        deadline = time.monotonic() + 5
        while not await slot_free():
            assert time.monotonic() < deadline, "the slot was not given back"
        await a.close()
        await b.close()

    run(go())


# -- leases: large limits, admitted from what each router holds ----------------------------


def test_large_limits_are_leased_a_share_at_a_time_not_asked_per_request(redis_url: str) -> None:
    key = ApiKey("k", "h", rpm=100_000, tpm=10_000_000, max_concurrent=1_000)
    assert leased(key) and not leased(ApiKey("small", "h", rpm=60, tpm=10_000_000))

    async def go() -> None:
        a, b = _routers(redis_url, 2)
        tickets = []
        for i in range(400):
            got = await (a, b)[i % 2].admit(key, 100, f"r{i}", T0 + i / 1000)
            assert isinstance(got, Ticket) and got.leased
            tickets.append(got)
        # A share is 1 % of each limit: 1,000 requests, 100,000 tokens, 10 slots. 400
        # requests of 100 tokens, all in flight at once: each router took slots 20 times
        # (10 at a time, none given back meanwhile), and requests and tokens once.
        assert a.leases.leases_taken + b.leases.leases_taken < 50
        for i, ticket in enumerate(tickets):
            await (a, b)[i % 2].settle(ticket, 10, T0 + 1)
        for limits in (a, b):
            lease = limits.leases._leases["k"]
            assert lease.in_flight == 0 and lease.slots == 10  # one share of slots kept
            await limits.close()

    run(go())


def test_a_leased_key_is_admitted_at_once_until_its_lease_runs_short(redis_url: str) -> None:
    """`admit_at_once` (a flight run by callbacks) takes from the lease with no round trip, and says
    None, wait for `admit`, when the lease is short or the key is not leased."""
    key = ApiKey("k", "h", rpm=1_000)  # a share: 10 requests

    async def go() -> None:
        (limits,) = _routers(redis_url, 1)
        assert limits.admit_at_once(key, 0, "r0", T0) is None  # nothing leased yet
        assert isinstance(await limits.admit(key, 0, "r1", T0), Ticket)
        got = [limits.admit_at_once(key, 0, f"r{i}", T0) for i in range(2, 20)]
        assert all(isinstance(g, Ticket) and g.leased for g in got[:9])
        assert got[9:] == [None] * 9 and limits.leases.leases_taken == 1
        assert limits.admit_at_once(ApiKey("s", "h", rpm=60), 0, "r", T0) is None
        refused = limits.admit_at_once(ApiKey("t", "h", tpm=1_000), 2_000, "r", T0)
        assert isinstance(refused, Refusal) and refused.limit == "tpm"
        memory = MemoryLimits()
        small = ApiKey("s", "h", rpm=1)
        assert isinstance(memory.admit_at_once(small, 0, "r", T0), Ticket)
        assert isinstance(memory.admit_at_once(small, 0, "r", T0), Refusal)
        await limits.close()

    run(go())


def test_a_key_in_steady_use_never_waits_for_its_lease(redis_url: str) -> None:
    """Half a share used, the next is asked for in the background: admissions by
    callbacks (no waiting) go on through a whole minute's worth of shares."""
    key = ApiKey("k", "h", rpm=2_000)  # a share: 20 requests

    async def go() -> None:
        (limits,) = _routers(redis_url, 1)
        assert isinstance(await limits.admit(key, 0, "r0", T0), Ticket)
        for i in range(200):
            got = limits.admit_at_once(key, 0, f"r{i}", T0 + i * 0.01)
            assert isinstance(got, Ticket), i
            await asyncio.sleep(0.002)  # the loop turns, as between requests
        assert limits.leases.leases_taken >= 10
        await limits.close()

    run(go())


@settings(max_examples=6, deadline=None)
@given(
    rpm=st.integers(200, 600),
    routers=st.integers(2, 4),
    rate=st.floats(1.5, 3.0),
    seed=st.integers(0, 1000),
)
@example(rpm=231, routers=2, rate=1.6010214237645373, seed=213)  # 232 got through once
def test_no_60_s_window_holds_more_leased_requests_than_the_limit(
    redis_url: str, rpm: int, routers: int, rate: float, seed: int
) -> None:
    """Several routers leasing one key, clients sending at `rate` times the limit for three
    minutes (on the clock the test moves): in no 60 s window are more than `rpm` requests
    admitted (the two-bucket estimate let 1,980 of 1,000 through), and over the three
    minutes at most two shares per router and two slices' worth fewer than the limit."""

    async def go() -> None:
        made = _routers(redis_url, routers)
        key = ApiKey("k", "h", rpm=rpm)
        rng = random.Random(seed)
        step = WINDOW / (rpm * rate)
        admitted: list[float] = []
        start = now = T0 - 9.5  # at the start of a minute
        while now < start + 3 * WINDOW:
            got = await rng.choice(made).admit(key, 0, "r", now)
            if isinstance(got, Ticket):
                admitted.append(now)
            now += step
        for end in admitted:
            assert sum(1 for t in admitted if end - WINDOW < t <= end) <= rpm
        shares = routers * 2 * (rpm // LEASE_SHARE)
        assert len(admitted) >= 3 * rpm - shares - 2 * rpm * SLICE / WINDOW
        for limits in made:
            await limits.close()

    run(go(), within=60)


def test_slots_go_back_as_requests_end_and_all_at_close(redis_url: str) -> None:
    async def go() -> None:
        prefix = f"test:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        key = ApiKey("k", "h", rpm=1_000, max_concurrent=200)
        first = await a.admit(key, 0, "r1", T0)
        assert isinstance(first, Ticket)
        store = a.client
        # Leased: a share of 10 requests and of 2 slots, one of each in use.
        assert await store.hget(f"{prefix}k:lease-requests", slice_of(T0)) == b"10"
        assert await store.hget(f"{prefix}k:lease-slots", a.name) == b"2"
        await a.settle(first, None, T0 + 1)
        assert await store.hget(f"{prefix}k:lease-slots", a.name) == b"2"  # a share kept
        await a.close()
        # Closed: everything it held is given back.
        (b,) = _routers(redis_url, 1, prefix)
        assert await b.client.hget(f"{prefix}k:lease-slots", a.name) is None
        assert await b.client.hget(f"{prefix}k:lease-requests", slice_of(T0)) == b"1"
        await b.close()

    run(go())


def test_a_lease_granted_to_a_cancelled_request_is_kept(redis_url: str) -> None:
    """The client goes away while its router waits for a lease: what the store granted is
    still the router's."""

    async def go() -> None:
        (a,) = _routers(redis_url, 1)
        key = ApiKey("k", "h", rpm=1_000, max_concurrent=200)
        asking = asyncio.ensure_future(a.admit(key, 0, "r1", T0))
        await asyncio.sleep(0)  # the admission runs until it waits for the store
        assert a.leases._leases["k"].fetching is not None and not asking.done()
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        await until("the lease recorded", lambda: a.leases.leases_taken == 1)
        lease = a.leases._leases["k"]
        assert (lease.left()[0], lease.slots, lease.in_flight) == (10, 2, 0)
        assert isinstance(await a.admit(key, 0, "r2", T0), Ticket)
        assert a.leases.leases_taken == 1
        await a.close()

    run(go())


def test_a_key_given_lower_limits_admits_no_more_from_its_old_lease(redis_url: str) -> None:
    """`ctl keys update` lowers a leased key's limits: what the router leased under the old
    ones is given back, and the new limit holds at once."""

    async def go() -> None:
        (a,) = _routers(redis_url, 1)
        before = ApiKey("k", "h", rpm=100_000)
        assert isinstance(await a.admit(before, 0, "r0", T0), Ticket)  # leased 1,000
        after = ApiKey("k", "h", rpm=300)
        got = [await a.admit(after, 0, f"r{i}", T0 + 1) for i in range(400)]
        assert sum(isinstance(g, Ticket) for g in got) == 299  # 300, less the one before
        await a.close()

    run(go())


def test_a_grant_lapses_when_its_slice_ends_and_gives_back_what_is_left(redis_url: str) -> None:
    """A grant counts in the store in the slice it was made in: a request admitted from it
    after that slice would lie in windows that no longer count it. What is left of it then
    goes back to the store."""

    async def go() -> None:
        (a,) = _routers(redis_url, 1)
        key = ApiKey("k", "h", rpm=1_000)  # a share: 10 requests
        assert isinstance(await a.admit(key, 0, "r0", T0), Ticket)  # T0 starts a slice
        taken = a.leases.leases_taken
        assert a.admit_at_once(key, 0, "r1", T0 + SLICE - 0.1) is not None
        assert a.admit_at_once(key, 0, "r2", T0 + SLICE) is None  # lapsed: ask the store
        assert isinstance(await a.admit(key, 0, "r3", T0 + SLICE), Ticket)
        assert a.leases.leases_taken == taken + 1
        # The first slice counts the two requests used of its grant, not the ten granted,
        # once the leftover has been given back (in the background, waited for by nothing).
        requests = f"{a.prefix}k:lease-requests"
        deadline = time.monotonic() + 10
        while await a.client.hget(requests, slice_of(T0)) != b"2":
            assert time.monotonic() < deadline, "the leftover was never given back"
            await asyncio.sleep(0.01)
        await a.close()

    run(go())


@pytest.mark.usefixtures("way")
def test_through_the_router_a_leased_key_settles_into_its_lease_without_the_store(
    redis_url: str,
) -> None:
    """A leased key at the proxy: after each answer its request is out of flight and the
    tokens it did not use are back in the router's lease, with no round trip for either."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        sim = create_simulator(SimSettings(model="m", ttft=0, itl=0))
        async with serving(sim) as engine:
            router = keyed(
                wall=wall,
                models=[RoutedModel(name="m", endpoints=[engine])],
                api_keys=[
                    {
                        "name": "alice",
                        "key": "alice-key",
                        "rpm": 1_000,
                        "tpm": 1_000_000,
                        "max_concurrent": 200,
                    }
                ],
                limits_store=redis_url,
            )
            limits = router.limits
            assert isinstance(limits, RedisLimits)
            limits.prefix = f"test:{uuid.uuid4().hex}:"
            limits.store.sync_clock = False  # the test's clock is the router's
            async with client_of(router) as c:
                c.headers["authorization"] = "Bearer alice-key"
                prompt = "abcdefghij " * 40  # 40 tokens to the simulator, 442 reserved
                body = {"model": "m", "prompt": prompt, "max_tokens": 10}
                reserved = token_bound(body, "/v1/completions", 1)
                for _ in range(3):
                    answer = await c.post("/v1/completions", json=body)
                    assert answer.status_code == 200
                    lease = limits.leases._leases["alice"]
                    assert lease.in_flight == 0 and not router.background
                # Leased once, a share: 10 requests and 10,000 tokens. Each request reserved
                # 121 tokens and used fewer, as the engine reported: settled, the lease holds
                # more than 10,000 less three reservations.
                assert limits.leases.leases_taken == 1
                requests, tokens = lease.left()
                assert requests == 10 - 3
                assert 10_000 - 3 * reserved < tokens < 10_000
            await router.close()

    run(go())


# -- slots, a store that restarts or hangs, and clocks that differ --------------------------


def test_the_slots_of_a_router_that_dies_free_themselves_and_a_live_ones_do_not(
    redis_url: str,
) -> None:
    """A router's requests in flight once held their slots for an hour after it died. Now a
    live router moves its deadlines on every RENEW_EVERY seconds; a dead one's lapse at
    most SLOT_TTL seconds after its last renewal."""

    async def go() -> None:
        prefix = f"test:{uuid.uuid4().hex}:"
        wall = FakeClock()
        wall.now = T0
        alive, dead, other = _routers(redis_url, 3, prefix, wall=wall)
        exact = ApiKey("e", "h", max_concurrent=2)
        lease = ApiKey("l", "h", rpm=10_000, max_concurrent=2)
        for key in (exact, lease):
            assert isinstance(await alive.admit(key, 0, "a", T0), Ticket)
            assert isinstance(await dead.admit(key, 0, "d", T0), Ticket)
            assert isinstance(await other.admit(key, 0, "o", T0), Refusal)
        # Time passes; the live router renews, the dead one cannot.
        for step in range(1, 4):
            wall.now = T0 + step * SLOT_TTL / 3
            await alive.renew()
        later = T0 + SLOT_TTL + 1
        for key in (exact, lease):
            got = await other.admit(key, 0, "o", later)
            assert isinstance(got, Ticket), key  # the dead router's slot is free
            assert isinstance(await other.admit(key, 0, "o2", later), Refusal), key
        for limits in (alive, other):
            await limits.close()
        await dead.store.client.aclose()

    run(go())


def test_a_failed_settlement_is_tried_again_and_a_restart_of_redis_loses_no_slot(
    tmp_path: Path,
) -> None:
    """After a restart of Redis a settlement went out on a stale pooled connection, was not
    tried again, and its slot stayed taken for an hour: a key of max_concurrent 4 admitted
    only 3. Now a settlement that fails is tried again at the next renewal, a command on a
    dead connection goes once more on a new one, and what Redis lost in a restart is
    counted again by the next renewal, exact and leased alike."""

    async def go(server: RedisServer) -> None:
        wall = FakeClock()
        wall.now = T0
        (a,) = _routers(server.url, 1, wall=wall)
        (b,) = _routers(server.url, 1, a.prefix)
        exact = ApiKey("e", "h", rpm=60, max_concurrent=4)
        lease = ApiKey("l", "h", rpm=10_000, max_concurrent=4)
        tickets = [await a.admit(exact, 0, f"r{i}", T0) for i in range(4)]
        held = [await a.admit(lease, 0, f"l{i}", T0) for i in range(3)]
        assert all(isinstance(t, Ticket) for t in tickets + held)
        # A settlement that times out (Redis hangs a moment) is tried again.
        server.pause()
        try:
            await a.settle(tickets[0], 0, T0 + 1)
        finally:
            server.resume()
        assert len(a.exact._settling) == 1
        wall.now = T0 + 2
        await a.renew()
        await until("the settlement tried again", lambda: not a.exact._settling)
        assert isinstance(await b.admit(exact, 0, "b0", T0 + 2), Ticket)  # its slot is free
        assert isinstance(await b.admit(exact, 0, "b1", T0 + 2), Refusal)
        # Redis restarts, empty: every count is lost.
        server.stop()
        server.start()
        await a.settle(tickets[1], 0, T0 + 3)  # on a stale connection: sent again, fine
        wall.now = T0 + 4
        await a.renew()  # a's two exact requests and three leased slots are counted again
        leased_slots = await a.client.hvals(a.store.keys("l")[4])
        assert [int(n) for n in leased_slots] == [3]
        got = [await b.admit(exact, 0, f"x{i}", T0 + 5) for i in range(4)]
        assert sum(isinstance(g, Ticket) for g in got) == 2  # a still holds two
        assert isinstance(await b.admit(lease, 0, "y0", T0 + 5), Ticket)
        assert isinstance(await b.admit(lease, 0, "y1", T0 + 5), Refusal)
        await a.close()
        await b.close()

    with running_redis(tmp_path) as server:
        run(go(server))


def test_a_hung_redis_costs_a_few_timeouts_then_nothing_until_it_answers(
    tmp_path: Path,
) -> None:
    """A silent Redis (not down) added a second to every request of an exact key. After
    three timeouts the breaker opens: requests go by `limits_fail` at once (refused, by
    default, naming why), until a probe is answered again."""

    async def go(server: RedisServer) -> None:
        (a,) = _routers(server.url, 1)
        key = ApiKey("k", "h", rpm=100)
        assert isinstance(await a.admit(key, 0, "r", T0), Ticket)
        server.pause()
        try:
            slow = [await a.admit(key, 0, f"s{i}", T0 + 1) for i in range(3)]
            assert all(isinstance(t, Refusal) and t.limit == "store" for t in slow)
            assert all("Timeout" in t.why for t in slow if isinstance(t, Refusal))
            assert a.store.breaker.open
            began = time.monotonic()
            fast = [await a.admit(key, 0, f"f{i}", T0 + 2) for i in range(100)]
            assert all(isinstance(t, Refusal) and t.limit == "store" for t in fast)
            assert time.monotonic() - began < 0.5  # no round trip among them (0.5 s each)
        finally:
            server.resume()
        await until("the breaker to close", lambda: not a.store.breaker.open, timeout=10)
        back = await a.admit(key, 0, "b", T0 + 3)
        assert isinstance(back, Ticket) and back.backed
        await a.close()

    with running_redis(tmp_path) as server:
        run(go(server))


def test_a_settlement_sent_twice_gives_its_tokens_back_once(redis_url: str) -> None:
    """A settlement whose answer timed out is sent again at the next renewal, though it may
    have run: it gave its unused tokens back twice, taking them from other requests'
    reservations, and a key of tpm 1,000 then had 1,400 reserved at once."""

    async def go() -> None:
        (a,) = _routers(redis_url, 1)
        key = ApiKey("k", "h", rpm=100, tpm=1_000, max_concurrent=10)  # counted exactly
        first = await a.admit(key, 600, "r1", T0)
        second = await a.admit(key, 400, "r2", T0)
        assert isinstance(first, Ticket) and isinstance(second, Ticket)
        await a.settle(first, 0, T0 + 1)
        await a.settle(first, 0, T0 + 1)  # the same settlement, again
        over = await a.admit(key, 1_000, "r3", T0 + 2)
        assert isinstance(over, Refusal) and over.limit == "tpm"  # 400 still reserved
        assert isinstance(await a.admit(key, 600, "r4", T0 + 2), Ticket)
        await a.close()

    run(go())


def test_an_admission_that_timed_out_gives_back_what_it_counted_once_redis_answers(
    tmp_path: Path,
) -> None:
    """Redis paused past the 0.5 s timeout: the router refused the request (503), but the
    script ran when Redis came back, and held the key's slot for 30 s and its tokens for a
    minute. Now the router settles such an admission as unused once Redis answers again."""

    async def go(server: RedisServer) -> None:
        a, b = _routers(server.url, 2, prefix=f"test:{uuid.uuid4().hex}:")
        key = ApiKey("k", "h", rpm=100, tpm=1_000, max_concurrent=1)
        warm = await a.admit(key, 10, "warm", T0)  # the script is loaded, a connection open
        assert isinstance(warm, Ticket)
        await a.settle(warm, 10, T0)
        server.pause()
        try:
            late = await a.admit(key, 900, "late", T0 + 1)
        finally:
            server.resume()
        assert isinstance(late, Refusal) and late.limit == "store"
        await a.renew()  # the renewal sends what could not be sent meanwhile
        deadline = time.monotonic() + 5
        while True:  # the admission that ran late is taken back: its tokens and its slot
            got = await b.admit(key, 990, "next", T0 + 2)
            if isinstance(got, Ticket):
                break
            assert time.monotonic() < deadline, f"still counted: {got}"
            await asyncio.sleep(0.05)
        await a.close()
        await b.close()

    with running_redis(tmp_path) as server:
        run(go(server))


def test_routers_whose_clocks_differ_count_on_redis_clock(redis_url: str) -> None:
    """A router whose clock ran 59.9 s ahead took the others' requests for a minute old, and
    let a key of 3 requests a minute through twice over (a 5 s skew did it 1.5 times). Each
    router reads Redis' clock and counts on it."""

    async def go() -> None:
        prefix = f"test:{uuid.uuid4().hex}:"
        (on_time,) = _routers(redis_url, 1, prefix, sync_clock=True)
        (ahead,) = _routers(redis_url, 1, prefix, sync_clock=True)
        ahead.wall = ahead.store.wall = lambda: time.time() + 59.9
        key = ApiKey("k", "h", rpm=3)
        for i in range(3):
            assert isinstance(await on_time.admit(key, 0, f"r{i}", on_time.wall()), Ticket)
        refused = await ahead.admit(key, 0, "late", ahead.wall())
        assert isinstance(refused, Refusal) and refused.limit == "rpm"
        assert abs(ahead.store.offset + 59.9 - on_time.store.offset) < 0.5
        await on_time.close()
        await ahead.close()

    run(go())


def test_a_key_unused_for_a_minute_gives_its_slots_back_and_is_forgotten(
    redis_url: str,
) -> None:
    """A share of slots kept for a key nobody uses any more would hold them as long as the
    router runs (the same mutation survived for leases at the minute's turn): after a minute
    unused, the renewal gives them back and forgets the lease."""

    async def go() -> None:
        wall = FakeClock()
        wall.now = T0
        (a,) = _routers(redis_url, 1, wall=wall)
        key = ApiKey("k", "h", rpm=1_000, max_concurrent=500)  # a share of 5 slots
        ticket = await a.admit(key, 0, "r", T0)
        assert isinstance(ticket, Ticket)
        await a.settle(ticket, 0, T0 + 1)
        slots = a.store.keys("k")[4]
        assert await a.client.hget(slots, a.name) == b"5"  # a share kept while in use
        wall.now = T0 + 30
        await a.renew()
        assert "k" in a.leases._leases and await a.client.hget(slots, a.name) == b"5"
        wall.now = T0 + WINDOW + 2
        await a.renew()
        await a.leases.given()
        assert await a.client.hget(slots, a.name) is None
        assert "k" not in a.leases._leases
        await a.close()

    run(go())
