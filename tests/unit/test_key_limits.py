"""A key's limits at the router in front of a real simulator: 429 with Retry-After and a body
naming the limit and the key, reservations settled to the engine's usage, and a stream's usage
asked of the engine without changing the stream the client asked for."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from modelfleet.core.token_bound import token_bound
from modelfleet.messages.wire import RoutedModel
from modelfleet.router import flight
from modelfleet.router.limits import MemoryLimits, Ticket
from modelfleet.router.service import Router
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator

from .router_kit import FakeClock, client_of, keyed, router_url, run, serving, until, upstream

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
    counts = limits._keys.get("alice")
    return 0 if counts is None else sum(counts.tokens.values())


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


@pytest.mark.usefixtures("way")
def test_a_request_reserves_the_largest_output_bound_it_names() -> None:
    """Issue 39: `max_tokens: 1` with `max_completion_tokens: 900` reserved 1 token and used
    900 (the engine obeys either): 9,010 tokens in a second on a 1,000 tpm key. The larger
    bound is reserved, so the request is refused before it runs."""
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
                body = {"model": "m", "prompt": "hi", "max_tokens": 1}
                refused = await c.post(
                    "/v1/completions", json={**body, "max_completion_tokens": 900}
                )
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["type"] == "tokens"
                assert (await c.post("/v1/completions", json=body)).status_code == 200

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


@pytest.mark.usefixtures("way")
def test_token_counts_that_are_not_whole_numbers_of_at_least_one_are_refused_unreserved() -> None:
    """A `max_tokens` of -1,000,000 once reserved a negative estimate, which the engine's 400
    never settled: the key's token window sank far below zero and let thousands through."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, client = limited(engine, wall, tpm=150)
            async with client as c:
                base = {"model": "m", "prompt": "hi"}
                bad = [
                    ("max_tokens", -1_000_000),
                    ("max_tokens", 0),
                    ("max_tokens", 1.5),
                    ("max_tokens", "10"),
                    ("max_tokens", True),
                    ("max_completion_tokens", -5),
                    ("n", 0),
                ]
                for name, value in bad:
                    refused = await c.post("/v1/completions", json={**base, name: value})
                    assert refused.status_code == 400, (name, value, refused.text)
                    error = refused.json()["error"]
                    assert error["param"] == name and name in error["message"]
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                refused = await c.post("/v1/chat/completions", json={**chat, "max_tokens": -1})
                assert refused.status_code == 400
                streamed = {**chat, "stream": True, "stream_options": 5}
                refused = await c.post("/v1/chat/completions", json=streamed)
                assert refused.status_code == 400
                assert refused.json()["error"]["param"] == "stream_options"
                assert tokens_counted(router) == 0  # nothing reserved, nothing below zero
                # The limit holds as before: 150 tokens admit a few requests of 20, not more.
                statuses = [
                    (await c.post("/v1/completions", json={**base, "max_tokens": 20})).status_code
                    for _ in range(10)
                ]
                assert statuses.count(200) == 7 and statuses[7:] == [429] * 3

    run(go())


@pytest.mark.usefixtures("way")
def test_an_engine_that_refuses_a_request_leaves_nothing_reserved() -> None:
    wall = FakeClock()
    wall.now = T0
    hits: list[int] = []

    async def go() -> None:
        async with upstream(400, hits) as engine:
            router, client = limited(engine, wall, tpm=10_000, max_concurrent=1)
            async with client as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 100}
                for _ in range(3):
                    assert (await c.post("/v1/completions", json=body)).status_code == 400
                    await until_settled(router)
                assert len(hits) == 3 and tokens_counted(router) == 0
                assert in_flight(router) == 0

    run(go())


def in_flight(router: Router) -> int:
    limits = router.limits
    assert isinstance(limits, MemoryLimits)
    counts = limits._keys.get("alice")
    return 0 if counts is None else counts.in_flight


@pytest.mark.usefixtures("way")
def test_a_client_that_hangs_up_before_its_answer_is_charged_its_reservation() -> None:
    """The engine goes on generating until it learns of the hang-up: the tokens were spent.
    A client that hung up was once charged nothing: 28,589 tokens in 63 s on a 3,000 tpm key."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        slow = SimSettings(model="m", ttft=0.01, itl=0.05)
        async with serving(create_simulator(slow)) as engine:
            router, _ = limited(engine, wall, tpm=100_000)
            async with router_url(router) as url:
                port = int(url.rsplit(":", 1)[1])
                body = json.dumps({"model": "m", "prompt": "abcdefgh" * 10, "max_tokens": 50})
                head = (
                    "POST /v1/completions HTTP/1.1\r\nhost: r\r\n"
                    "authorization: Bearer alice-key\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n"
                )
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head.encode() + body.encode())
                await writer.drain()
                await until("the request admitted", lambda: in_flight(router) == 1)
                writer.close()  # hang up well before the 50 tokens' 2.5 s
                await until("the hang-up noticed", lambda: in_flight(router) == 0)
                await until_settled(router)
                reserved = token_bound(json.loads(body), "/v1/completions", 1)
                assert tokens_counted(router) == reserved == 80 + 2 + 50  # all of it

    run(go())


@pytest.mark.usefixtures("way")
def test_an_endpoint_the_router_cannot_send_to_is_a_503_that_frees_the_keys_slot() -> None:
    """The callback path (then a "fast lane" of its own) once raised on an https:// endpoint:
    a 500, and the key's only slot taken until the router restarted."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        router, client = limited("https://127.0.0.1:9", wall, max_concurrent=1)
        async with client as c:
            body = {"model": "m", "prompt": "hi", "max_tokens": 5}
            for _ in range(2):
                answer = await c.post("/v1/completions", json=body)
                assert answer.status_code == 503, answer.text
                assert answer.headers["x-modelfleet-reason"] == "upstream-failed"
                await until_settled(router)
                assert in_flight(router) == 0

    run(go())


@pytest.mark.usefixtures("way")
def test_a_step_that_fails_in_a_callback_is_a_500_that_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in a step run by the engine connection's callback must not leave the request
    hanging with its key's slot and its replica's count taken: it is answered with a 500,
    and ended as any other request."""
    wall = FakeClock()
    wall.now = T0
    original = flight.Flight._answered
    failures = [RuntimeError("a bug")]

    def failing(self: flight.Flight, *args: object) -> None:
        if failures:
            raise failures.pop()
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(flight.Flight, "_answered", failing)

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, client = limited(engine, wall, max_concurrent=1)
            async with client as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 5}
                broken = await c.post("/v1/completions", json=body)
                assert broken.status_code == 500, broken.text
                assert broken.json()["error"]["type"] == "server_error"
                await until_settled(router)
                assert in_flight(router) == 0
                assert router.balancer.in_flight().get(engine, 0) == 0
                after = await c.post("/v1/completions", json=body)  # the only slot is free
                assert after.status_code == 200, after.text
                assert not failures

    run(go())


@pytest.mark.usefixtures("way")
def test_a_model_name_the_table_does_not_know_makes_no_label_and_no_usage_row() -> None:
    """Issue 39: any key holder's model name, existing or not, became a permanent metric
    label and usage row (18 series each; a 20,000-character name broke `ctl usage`). A name
    the table does not know is counted under the one label "-"; a name that is no name (too
    long, or of characters a name does not have) is refused (400) saying why."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, client = limited(engine, wall)
            async with client as c:
                for name in ("nope", "llama/nope:v2"):
                    body = {"model": name, "prompt": "hi", "max_tokens": 1}
                    assert (await c.post("/v1/completions", json=body)).status_code == 404
                for name in ("x" * 20_000, "<script>", "../../etc"):
                    body = {"model": name, "prompt": "hi", "max_tokens": 1}
                    refused = await c.post("/v1/completions", json=body)
                    assert refused.status_code == 400, refused.text
                    assert refused.json()["error"]["param"] == "model"
                    assert len(refused.text) < 1000  # the name is not echoed whole
                ok = {"model": "m", "prompt": "hi", "max_tokens": 1}
                assert (await c.post("/v1/completions", json=ok)).status_code == 200
                page = (await router.metrics_text()).decode()
            await until_settled(router)
            labels = set(re.findall(r'model="([^"]*)"', page))
            assert labels <= {"m", "-"} and "m" in labels, labels
            batch = router.ledger.take()
            assert batch is not None
            assert sorted({row.model for row in batch.rows}) == ["-", "m"]

    run(go())


@pytest.mark.usefixtures("way")
def test_a_key_at_its_concurrency_gets_429_before_its_body_is_read() -> None:
    """Issue 56: a key limited to one request at a time made the router hold 30 bodies of
    9.5 MiB, each read whole before its admission refused it. Now a key may have no more
    bodies being read at once than requests at once: ten clients of a key of one send the
    head of a 5 MiB body and 100 KiB of it, and all but one get 429 before they send more."""
    wall = FakeClock()
    wall.now = T0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router, _ = limited(engine, wall, max_concurrent=1)
            async with router_url(router) as url:
                host, port = url.removeprefix("http://").split(":")
                size = 5 * 2**20
                head = (
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer alice-key"
                    f"\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
                ).encode()
                clients = [await asyncio.open_connection(host, int(port)) for _ in range(10)]
                for _, writer in clients:
                    writer.write(head + b" " * 100_000)

                async def answer(reader: asyncio.StreamReader) -> bytes:
                    try:
                        return await asyncio.wait_for(reader.readline(), 5)
                    except TimeoutError:
                        return b"still reading its body"

                answers = await asyncio.gather(*(answer(reader) for reader, _ in clients))
                refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
                assert len(refused) == 9, answers
                for _, writer in clients:
                    writer.close()

    run(go())
