"""Per-key limits: the sliding minute's arithmetic, and the same behaviour whether the counters
live in one router's memory or in a real Redis server shared by two routers."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.router.limits import (
    LEASE_SHARE,
    WINDOW,
    Limits,
    MemoryLimits,
    RedisLimits,
    Refusal,
    Ticket,
    bucket_of,
    leased,
    over,
    retry_after,
)
from modelfleet.router.table import ApiKey
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator
from modelfleet.wire import RoutedModel

from ..redis_kit import redis_server
from .router_kit import FakeClock, client_of, keyed, run, serving, until

T0 = 1000 * WINDOW + 10.0  # 10 s into a minute bucket


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


Backends = Callable[[], Awaitable[list[Limits]]]


@pytest.fixture(params=["memory", "redis"])
def backends(request: pytest.FixtureRequest, tmp_path: Path) -> Backends:
    """Two routers' limits: with memory, one router's (the only case where it is right);
    with Redis, two clients of one server, as two routers have."""

    async def make() -> list[Limits]:
        if request.param == "memory":
            one = MemoryLimits()
            return [one, one]
        url = request.getfixturevalue("redis_url")
        prefix = f"test:{request.node.name}:{tmp_path.name}:"  # each test its own counters
        made = []
        for _ in range(2):
            limits = RedisLimits.from_url(url)
            limits.prefix = prefix
            made.append(limits)
        return made

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

    run(go())


@given(
    previous=st.integers(0, 500),
    current=st.integers(0, 500),
    cost=st.integers(1, 100),
    limit=st.integers(1, 500),
    elapsed=st.floats(0, 0.999),
)
def test_after_retry_after_the_request_fits_and_not_much_before(
    previous: int, current: int, cost: int, limit: int, elapsed: float
) -> None:
    if cost > limit or not over(previous, current, cost, limit, elapsed):
        return
    wait = retry_after(previous, current, cost, limit, elapsed)

    def over_at(seconds: float) -> bool:
        at = elapsed + seconds / WINDOW
        if at < 1:
            return over(previous, current, cost, limit, at)
        if at < 2:  # the next bucket: the current one has become the previous
            return over(current, 0, cost, limit, at - 1)
        return over(0, 0, cost, limit, at - math.floor(at))

    assert not over_at(wait + 1e-6)
    if wait > 0.01:
        assert over_at(wait - 0.01)


# -- leases: large limits, admitted from what each router holds ----------------------------


def _routers(url: str, n: int, prefix: str) -> list[RedisLimits]:
    made = []
    for _ in range(n):
        limits = RedisLimits.from_url(url)
        limits.prefix = prefix
        made.append(limits)
    return made


def test_large_limits_are_leased_a_share_at_a_time_not_asked_per_request(redis_url: str) -> None:
    key = ApiKey("k", "h", rpm=100_000, tpm=10_000_000, max_concurrent=1_000)
    assert leased(key) and not leased(ApiKey("small", "h", rpm=60, tpm=10_000_000))

    async def go() -> None:
        a, b = _routers(redis_url, 2, "test:lease-share:")
        tickets = []
        for i in range(400):
            got = await (a, b)[i % 2].admit(key, 100, f"r{i}", T0 + i / 1000)
            assert isinstance(got, Ticket) and got.leased
            tickets.append(got)
        # A share is 1 % of each limit: 1,000 requests, 100,000 tokens, 10 slots. 400
        # requests of 100 tokens: each router leased tokens twice, slots 20 times (10 at a
        # time, none given back while its requests were in flight).
        assert a.leases_taken + b.leases_taken < 50
        for i, ticket in enumerate(tickets):
            await (a, b)[i % 2].settle(ticket, 10, T0 + 1)
        for limits in (a, b):
            assert limits._leases["k"].slots == limits._leases["k"].in_flight + 10
            await limits.close()

    run(go())


def test_a_leased_key_is_admitted_at_once_until_its_lease_runs_short(redis_url: str) -> None:
    """`admit_at_once` (the fast lane's) takes from the lease with no round trip, and says
    None, wait for `admit`, when the lease is short or the key is not leased."""
    key = ApiKey("k", "h", rpm=1_000)  # a share: 10 requests

    async def go() -> None:
        (limits,) = _routers(redis_url, 1, f"test:at-once:{uuid.uuid4().hex}:")
        assert limits.admit_at_once(key, 0, "r0", T0) is None  # nothing leased yet
        assert isinstance(await limits.admit(key, 0, "r1", T0), Ticket)
        got = [limits.admit_at_once(key, 0, f"r{i}", T0) for i in range(2, 20)]
        assert all(isinstance(g, Ticket) and g.leased for g in got[:9])
        assert got[9:] == [None] * 9 and limits.leases_taken == 1
        assert limits.admit_at_once(ApiKey("s", "h", rpm=60), 0, "r", T0) is None
        refused = limits.admit_at_once(ApiKey("t", "h", tpm=1_000), 2_000, "r", T0)
        assert isinstance(refused, Refusal) and refused.limit == "tpm"
        memory = MemoryLimits()
        small = ApiKey("s", "h", rpm=1)
        assert isinstance(memory.admit_at_once(small, 0, "r", T0), Ticket)
        assert isinstance(memory.admit_at_once(small, 0, "r", T0), Refusal)
        await limits.close()

    run(go())


@settings(max_examples=12, deadline=None)
@given(
    rpm=st.integers(200, 900),
    routers=st.integers(1, 3),
    requests=st.integers(1, 1200),
)
def test_leases_never_let_more_through_than_the_limit(
    redis_url: str, rpm: int, routers: int, requests: int
) -> None:
    """However the requests fall over the routers, at most the limit is admitted, and at
    most one share per router less (what each holds unused)."""

    async def go() -> None:
        prefix = f"test:lease-bound:{uuid.uuid4().hex}:"
        made = _routers(redis_url, routers, prefix)
        key = ApiKey("k", "h", rpm=rpm)
        rng = random.Random(rpm * 31 + requests)
        got = await asyncio.gather(
            *(rng.choice(made).admit(key, 0, f"r{i}", T0) for i in range(requests))
        )
        admitted = sum(isinstance(g, Ticket) for g in got)
        assert admitted <= rpm
        assert admitted >= min(requests, rpm - routers * (rpm // LEASE_SHARE))
        for limits in made:
            await limits.close()

    run(go())


def test_a_new_minute_gives_the_old_lease_back_and_slots_go_back_as_requests_end(
    redis_url: str,
) -> None:
    async def go() -> None:
        prefix = f"test:lease-roll:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        key = ApiKey("k", "h", rpm=1_000, max_concurrent=200)
        first = await a.admit(key, 0, "r1", T0)
        assert isinstance(first, Ticket)
        bucket = first.bucket
        store = a.client
        # Leased: a share of 10 requests and of 2 slots, one of each in use.
        assert await store.get(f"{prefix}k:lease-requests:{bucket}") == b"10"
        assert await store.hget(f"{prefix}k:lease-slots", a.name) == b"2"
        await a.settle(first, None, T0 + 1)
        assert await store.hget(f"{prefix}k:lease-slots", a.name) == b"2"  # a share kept
        # The next minute: until the key's renewal lands, what is left of the last minute's
        # lease admits (counted in that minute); then the rest of it goes back.
        later = await a.admit(key, 0, "r2", T0 + WINDOW)
        assert isinstance(later, Ticket) and later.bucket == bucket
        await until("the renewal", lambda: a._leases["k"].fetching is None)
        flusher = a._return_flusher
        await until("the give-back", lambda: flusher is None or flusher.done())
        assert await store.get(f"{prefix}k:lease-requests:{bucket}") == b"2"
        assert await store.get(f"{prefix}k:lease-requests:{bucket + 1}") == b"10"
        third = await a.admit(key, 0, "r3", T0 + WINDOW + 1)
        assert isinstance(third, Ticket) and third.bucket == bucket + 1
        await a.close()
        # Closed: everything it held is given back.
        (b,) = _routers(redis_url, 1, prefix)
        assert await b.client.hget(f"{prefix}k:lease-slots", a.name) is None
        assert await b.client.get(f"{prefix}k:lease-requests:{bucket + 1}") == b"1"
        await b.close()

    run(go())


def test_a_lease_granted_to_a_cancelled_request_is_kept(redis_url: str) -> None:
    """The client goes away while its router waits for a lease: what the store granted is
    still the router's, not lost until the bucket ends (or, for slots, for an hour)."""

    async def go() -> None:
        prefix = f"test:lease-cancel:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        key = ApiKey("k", "h", rpm=1_000, max_concurrent=200)
        asking = asyncio.ensure_future(a.admit(key, 0, "r1", T0))
        await asyncio.sleep(0)  # the admission runs until it waits for the store
        assert a._leases["k"].fetching is not None and not asking.done()
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        await until("the lease recorded", lambda: a.leases_taken == 1)
        lease = a._leases["k"]
        assert (lease.requests, lease.slots, lease.in_flight) == (10, 2, 0)
        assert isinstance(await a.admit(key, 0, "r2", T0), Ticket)
        assert a.leases_taken == 1
        await a.close()

    run(go())


def test_keys_used_last_minute_have_their_lease_renewed_together_when_it_turns(
    redis_url: str,
) -> None:
    async def go() -> None:
        prefix = f"test:lease-renew:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        keys = [ApiKey(f"k{i}", "h", rpm=1_000, tpm=100_000) for i in range(20)]
        idle = ApiKey("idle", "h", rpm=1_000)
        tickets = [await a.admit(idle, 0, "r", T0 - WINDOW)]
        tickets += [await a.admit(key, 10, "r", T0) for key in keys]
        assert all(isinstance(t, Ticket) for t in tickets)
        await until("the idle key's renewal", lambda: a._leases["idle"].fetching is None)
        taken = a.leases_taken
        # The next minute: its first admission renews every key used in the last one, in
        # one round trip; the idle key is not renewed.
        later = T0 + WINDOW
        tickets.append(await a.admit(keys[0], 10, "r", later))
        await until("the renewal", lambda: all(le.fetching is None for le in a._leases.values()))
        tickets += [await a.admit(key, 10, "r", later + 1) for key in keys[1:]]
        assert all(isinstance(t, Ticket) for t in tickets)
        assert a.leases_taken == taken + 1
        bucket = bucket_of(later)[0]
        assert await a.client.get(f"{prefix}k5:lease-requests:{bucket}") == b"10"
        assert await a.client.get(f"{prefix}idle:lease-requests:{bucket}") is None
        # Their requests end. A minute later only k0 is used, and after another the rest are
        # forgotten: they held nothing for a minute.
        for ticket in tickets:
            assert isinstance(ticket, Ticket)
            await a.settle(ticket, 10, later + 2)
        assert isinstance(await a.admit(keys[0], 10, "r", later + WINDOW), Ticket)
        await until("the renewal", lambda: all(le.fetching is None for le in a._leases.values()))
        assert isinstance(await a.admit(keys[0], 10, "r", later + 2 * WINDOW), Ticket)
        assert set(a._leases) == {"k0"}
        await a.close()

    run(go())


def test_a_key_given_lower_limits_admits_no_more_from_its_old_lease(redis_url: str) -> None:
    """`ctl keys update` lowers a leased key's limits: what the router leased under the old
    ones is given back, and the new limit holds at once."""

    async def go() -> None:
        prefix = f"test:lease-change:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        before = ApiKey("k", "h", rpm=100_000)
        assert isinstance(await a.admit(before, 0, "r0", T0), Ticket)  # leased 1,000
        after = ApiKey("k", "h", rpm=300)
        got = [await a.admit(after, 0, f"r{i}", T0 + 1) for i in range(400)]
        assert sum(isinstance(g, Ticket) for g in got) == 299  # 300, less the one before
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
            limits.prefix = f"test:lease-proxy:{uuid.uuid4().hex}:"
            async with client_of(router) as c:
                c.headers["authorization"] = "Bearer alice-key"
                prompt = "abcdefghij " * 40  # 40 tokens to the simulator, 111 estimated
                body = {"model": "m", "prompt": prompt, "max_tokens": 10}
                reserved = len(prompt) // 4 + 1 + 10
                for _ in range(3):
                    answer = await c.post("/v1/completions", json=body)
                    assert answer.status_code == 200
                    lease = limits._leases["alice"]
                    assert lease.in_flight == 0 and not router.background
                # Leased once, a share: 10 requests and 10,000 tokens. Each request reserved
                # 121 tokens and used fewer, as the engine reported: settled, the lease holds
                # more than 10,000 less three reservations.
                assert limits.leases_taken == 1
                assert lease.requests == 10 - 3
                assert 10_000 - 3 * reserved < lease.tokens < 10_000
            await router.close()

    run(go())


def test_many_keys_are_renewed_in_small_pipelines_one_after_another(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A minute's turn renews every key used in the last one, in pipelines of `RENEW_BATCH`
    sent one at a time: pipelines sent all at once held the event loop for 20 ms."""
    sizes: list[int] = []  # each pipeline's keys
    under_way = [0, 0]  # pipelines under way now, and at most
    original = RedisLimits._renew

    async def counted(self: RedisLimits, batch: list[Any], now: float) -> Any:
        sizes.append(len(batch))
        under_way[0] += 1
        under_way[1] = max(under_way)
        try:
            return await original(self, batch, now)
        finally:
            under_way[0] -= 1

    monkeypatch.setattr(RedisLimits, "_renew", counted)

    async def go() -> None:
        prefix = f"test:lease-batches:{uuid.uuid4().hex}:"
        (a,) = _routers(redis_url, 1, prefix)
        keys = [ApiKey(f"k{i}", "h", rpm=1_000) for i in range(250)]
        for key in keys:
            assert isinstance(await a.admit(key, 0, "r", T0), Ticket)
        taken = a.leases_taken
        assert isinstance(await a.admit(keys[0], 0, "r", T0 + WINDOW), Ticket)
        await until("the renewals", lambda: all(le.fetching is None for le in a._leases.values()))
        assert a.leases_taken == taken + 10 and sizes == [25] * 10  # 250 keys
        assert under_way == [0, 1]
        assert all(a._leases[k.name].requests == 10 for k in keys[1:])
        await a.close()

    run(go())
