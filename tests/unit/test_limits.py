"""Per-key limits: the sliding minute's arithmetic, and the same behaviour whether the counters
live in one router's memory or in a real Redis server shared by two routers."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.router.limits import (
    WINDOW,
    Limits,
    MemoryLimits,
    RedisLimits,
    Refusal,
    Ticket,
    over,
    retry_after,
)
from modelfleet.router.table import ApiKey

from ..redis_kit import redis_server
from .router_kit import run

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
