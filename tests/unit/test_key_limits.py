"""A key's limits at the router in front of a real simulator: 429 with Retry-After and a body
naming the limit and the key, reservations settled to the engine's usage, and a stream's usage
asked of the engine without changing the stream the client asked for."""

from __future__ import annotations

import json

import httpx
import pytest

from modelfleet.router.limits import MemoryLimits, Ticket
from modelfleet.router.service import Router
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator
from modelfleet.wire import RoutedModel

from .router_kit import FakeClock, client_of, keyed, run, serving

T0 = 60_000.0 + 10  # 10 s into a minute


def limited(engine: str, wall: FakeClock, **limits: int) -> tuple[Router, httpx.AsyncClient]:
    """A router in front of `engine` whose one key, alice's, has `limits`; and its client."""
    router = keyed(
        wall=wall,
        models=[RoutedModel(name="m", endpoints=[engine])],
        api_keys=[{"name": "alice", "key": "alice-key", **limits}],
    )
    client = client_of(router)
    client.headers["authorization"] = "Bearer alice-key"
    return router, client


def tokens_counted(router: Router) -> int:
    limits = router.limits
    assert isinstance(limits, MemoryLimits)
    return limits._keys["alice"].tokens.get(int(T0 // 60), 0)


async def until_settled(router: Router) -> None:
    while router.background:
        await next(iter(router.background))


@pytest.mark.usefixtures("way")
def test_over_its_rpm_a_key_gets_429_with_retry_after_naming_the_limit_not_the_key() -> None:
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            _, client = limited(engine, wall, rpm=2)
            async with client as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 2}
                assert [(await c.post("/v1/completions", json=body)).status_code
                        for _ in range(2)] == [200, 200]  # fmt: skip
                refused = await c.post("/v1/completions", json=body)
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "60"  # when the first is a minute old
                assert refused.headers["x-modelfleet-reason"] == "key-rpm"
                error = refused.json()["error"]
                assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
                assert (
                    "key 'alice'" in error["message"]
                    and "2 requests per minute" in (error["message"])
                )
                assert "alice-key" not in refused.text
                wall.now += 60.5
                assert (await c.post("/v1/completions", json=body)).status_code == 200

    run(go())


@pytest.mark.usefixtures("way")
def test_a_token_limit_is_held_by_the_reservation_and_settled_to_the_engines_usage() -> None:
    """Two requests of max_tokens 400 reserve about 800 of a 1,000 tpm key, so a third is
    refused while they run; each used far fewer, and once settled a third fits."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, client = limited(engine, wall, tpm=1000)
            async with client as c:
                key = router.keys.check("Bearer alice-key", T0)
                assert not isinstance(key, str)
                held = await router.limits.admit(key, 400, "in flight elsewhere", T0)
                assert isinstance(held, Ticket)
                body = {"model": "m", "prompt": "hi", "max_tokens": 400}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
                await until_settled(router)
                # It reserved about 401 and used its prompt and 400 at most: settled to what
                # the simulator reported.
                used = tokens_counted(router) - 400
                assert 0 < used <= 401
                refused = await c.post("/v1/completions", json={**body, "max_tokens": 700})
                assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
                assert "1000 tokens per minute" in refused.json()["error"]["message"]

    run(go())


def sse_events(text: str) -> list[dict[str, object]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.usefixtures("way")
def test_a_streams_usage_is_counted_and_shown_only_to_a_client_that_asked_for_it() -> None:
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, client = limited(engine, wall, tpm=100_000)
            async with client as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
                plain = await c.post("/v1/completions", json=body)
                events = sse_events(plain.text)
                assert plain.text.rstrip().endswith("data: [DONE]")
                assert events and all(e["choices"] for e in events)
                assert all(e.get("usage") is None for e in events)
                await until_settled(router)
                after_one = tokens_counted(router)
                asked = await c.post(
                    "/v1/completions",
                    json={**body, "stream_options": {"include_usage": True}},
                )
                usage = sse_events(asked.text)[-1]
                assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
                await until_settled(router)
                total = usage["usage"]["total_tokens"]
                assert tokens_counted(router) == after_one + total
                assert after_one == total  # the first, hidden, counted the same

    run(go())
