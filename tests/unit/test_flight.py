"""A request's flight (`router/flight.py`) carried by callbacks, at the moments where it
changes course: an engine that fails, is silent, closes a kept-alive connection, or answers
in pieces; a client that leaves; a shutdown with a request in flight.

A flight runs without a task only while a kept-alive connection to the engine is idle, so
each test's engine answers the first request on a connection plainly, and behaves as the
test needs from the second on. Which way the flight went is seen by spies on its steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from modelfleet.http.http1 import Http1Server
from modelfleet.http.serving import Listener
from modelfleet.messages.wire import RoutedModel
from modelfleet.router import flight
from modelfleet.router.service import create_apps

from .router_kit import keyed, run, until, upstream

COMPLETION = {"model": "m", "prompt": "x"}
ANSWER = json.dumps({"choices": [{"index": 0, "text": "ok"}], "usage": {
    "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}).encode()  # fmt: skip


class RawEngine:
    """An engine on 127.0.0.1 that answers the first request on each connection with 200,
    and later ones as `later` says: "503", "silent" (until the connection closes), "close"
    (without a byte), "hold" (the whole answer once `go_on` is set), or "split" (the head
    and half the body, the rest once `go_on` is set).
    """

    def __init__(self, later: str) -> None:
        self.later = later
        self.requests = 0
        self.connections = 0
        self.closed = 0  # connections the router closed
        self.go_on = asyncio.Event()
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                action = "answer" if first else self.later
                first = False
                if action == "close":
                    writer.close()
                    return
                if action == "silent":
                    await reader.read()  # returns at the router's close
                    self.closed += 1
                    return
                if action == "hold":
                    await self.go_on.wait()
                status = b"503 Service Unavailable" if action == "503" else b"200 OK"
                writer.write(
                    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % (status, len(ANSWER))
                )
                if action == "split":
                    writer.write(ANSWER[:10])
                    await writer.drain()
                    await self.go_on.wait()
                    writer.write(ANSWER[10:])
                else:
                    writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self.url
        finally:
            server.close()


@contextlib.asynccontextmanager
async def lane_server(router: Any) -> AsyncIterator[tuple[Http1Server, httpx.AsyncClient]]:
    """`router`'s client app on the lean server, which hands requests to `Proxy.take`; a
    client of it."""
    app, _ = create_apps(router)
    listener = Listener("router", app)
    sock = listener.bind()
    server = Http1Server(app, take=app.proxy.take)
    await server.start(sock)
    headers = {"authorization": "Bearer client-key"}
    try:
        async with httpx.AsyncClient(base_url=listener.url, headers=headers) as client:
            yield server, client
    finally:
        await server.shutdown(drain_timeout=1)


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts of what flights did: attempts sent, failed, timed out, sent again on a new
    connection, abandoned, handed to a task, relayed by one."""
    seen: Counter[str] = Counter()

    def spy(owner: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    spy(flight.Attempt, "send")
    for name in ("timed_out", "_failed", "_connect", "gone", "_carry", "_relay"):
        spy(flight.Flight, name)
    return seen


def test_a_pooled_request_is_answered_without_a_task_as_the_proxy_answers_it(
    spied: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks: list[object] = []
    original = Http1Server.task_done

    def counting(self: Http1Server, task: asyncio.Task[None]) -> None:
        tasks.append(task)
        original(self, task)

    monkeypatch.setattr(Http1Server, "task_done", counting)

    async def go() -> None:
        engine = RawEngine("answer")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url], replicas={url: "r1"})])
            proxy_app, _ = create_apps(router)
            by_proxy = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=proxy_app),
                base_url="http://router",
                headers={"authorization": "Bearer client-key", "x-request-id": "req-1"},
            )
            async with lane_server(router) as (_, client), by_proxy:
                first = await client.post("/v1/completions", json=COMPLETION)
                assert first.status_code == 200 and len(tasks) == 1  # a new connection: a task
                lane = [
                    await client.post(
                        "/v1/completions", json=COMPLETION, headers={"x-request-id": "req-1"}
                    )
                    for _ in range(5)
                ]
                # Six attempts sent, one task: the first request's, which waited for a connection.
                assert spied["send"] == 6 and len(tasks) == 1 and engine.connections == 1
                proxied = await by_proxy.post("/v1/completions", json=COMPLETION)
                for answer in lane:
                    assert answer.status_code == proxied.status_code == 200
                    assert answer.content == proxied.content == ANSWER
                    for name in ("content-type", "content-length", "x-request-id"):
                        assert answer.headers[name] == proxied.headers[name], name
                    assert answer.headers["x-modelfleet-replica"] == "r1"
                page = (await router.metrics_text()).decode()
                assert 'modelfleet_router_requests_total{model="m",status="200"} 7.0' in page
                assert f'modelfleet_router_in_flight{{endpoint="{url}"}} 0.0' in page
                batch = router.ledger.take()  # the engine's usage, counted per request
                assert batch is not None
                rows = batch.rows
                assert sum(r.requests for r in rows) == 7
                assert sum(r.prompt_tokens for r in rows) == 21
            await router.close()

    run(go())


def test_a_replica_failing_by_callbacks_is_left_for_another(spied: Counter[str]) -> None:
    async def go() -> None:
        flaky = RawEngine("503")
        hits: list[int] = []
        async with flaky.running() as bad, upstream(200, hits) as good:
            router = keyed(models=[RoutedModel(name="m", endpoints=[bad, good])])
            router.balancer.set_engine_load(good, 5)  # the flaky one is picked first
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                assert flaky.requests == 1 and not hits
                retried = await client.post("/v1/completions", json=COMPLETION)
                assert retried.status_code == 200, retried.text
                assert spied["_failed"] == 1 and flaky.requests == 2 and hits == [200]
                page = (await router.metrics_text()).decode()
                assert 'modelfleet_router_retries_total{model="m"} 1.0' in page
            await router.close()

    run(go())


def test_a_replica_silent_by_callbacks_times_out_and_is_abandoned(spied: Counter[str]) -> None:
    async def go() -> None:
        engine = RawEngine("silent")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url], first_byte_timeout=0.2)])
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                late = await client.post("/v1/completions", json=COMPLETION)
                assert late.status_code == 504, late.text
                assert late.headers["x-modelfleet-reason"] == "first-byte-timeout"
                assert spied["timed_out"] == 1
                await until("the engine to see its request abandoned", lambda: engine.closed == 1)
            await router.close()

    run(go())


def test_a_kept_alive_connection_the_engine_closed_carries_the_request_anew(
    spied: Counter[str],
) -> None:
    """The engine closed the connection as the request went out, before a byte of an answer:
    it never began the request, which goes again on a new connection, even to the same
    replica, and counts as no failure."""

    async def go() -> None:
        engine = RawEngine("close")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url])])
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                again = await client.post("/v1/completions", json=COMPLETION)
                assert again.status_code == 200, again.text
                # New connections: the first request's, and the one that carried the second anew.
                assert spied["_connect"] == 2 and spied["_failed"] == 0
                assert engine.connections == 2 and engine.requests == 3
                assert router.balancer.state[url].failures == 0
            await router.close()

    run(go())


def test_an_answer_that_does_not_come_whole_is_relayed_by_a_task(spied: Counter[str]) -> None:
    async def go() -> None:
        engine = RawEngine("split")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url])])
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                pending = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
                await until("the flight to hand the relay to a task", lambda: spied["_relay"] == 1)
                engine.go_on.set()
                answer = await pending
                assert answer.status_code == 200 and answer.content == ANSWER
                batch = router.ledger.take()
                assert batch is not None
                assert sum(r.completion_tokens for r in batch.rows) == 4
            await router.close()

    run(go())


def test_a_client_gone_carried_by_callbacks_aborts_the_request_at_the_engine(
    spied: Counter[str],
) -> None:
    async def go() -> None:
        engine = RawEngine("silent")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url])])
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                pending = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
                await until("the engine to get the request", lambda: engine.requests == 2)
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                await until("the engine to see the request abandoned", lambda: engine.closed == 1)
                assert spied["gone"] == 1
                page = (await router.metrics_text()).decode()
                assert 'modelfleet_router_client_disconnects_total{model="m"} 1.0' in page
                assert f'modelfleet_router_in_flight{{endpoint="{url}"}} 0.0' in page
            await router.close()

    run(go())


def test_shutdown_waits_for_a_request_carried_by_callbacks(spied: Counter[str]) -> None:
    """A request whose flight waits on callbacks has no task, yet shutdown waits for its answer."""

    async def go() -> None:
        engine = RawEngine("hold")
        async with engine.running() as url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[url])])
            async with lane_server(router) as (server, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                pending = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
                await until("the engine to hold the request", lambda: engine.requests == 2)
                assert spied["send"] == 2 and server.taken and not server.tasks
                stopping = asyncio.create_task(server.shutdown(drain_timeout=10))
                await until("the listener to stop", lambda: server.stopping)
                assert not stopping.done()
                engine.go_on.set()
                answer = await pending
                assert answer.status_code == 200 and answer.content == ANSWER
                await asyncio.wait_for(stopping, 5)
                assert not server.taken
            await router.close()

    run(go())


def test_requests_waiting_on_an_engine_found_unreachable_go_to_another_at_once(
    spied: Counter[str],
) -> None:
    """A host cut off answers nothing, not even a reset: a request already written to its
    engine would wait out the first-byte timeout. Once the router's reads of that engine's
    load go unanswered twice in a row, the engine is ejected and the waiting request goes to
    another replica at once."""

    async def go() -> None:
        cut_off = RawEngine("silent")
        hits: list[int] = []
        async with cut_off.running() as bad, upstream(200, hits) as good:
            models = [RoutedModel(name="m", endpoints=[bad, good], first_byte_timeout=60)]
            router = keyed(models=models)
            router.balancer.set_engine_load(good, 5)  # the cut-off one is picked first
            async with lane_server(router) as (_, client):
                assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                waiting = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
                await until(
                    "the request to wait on the cut-off engine", lambda: cut_off.requests == 2
                )
                router.engines._no_answer(bad)
                assert not waiting.done() and router.balancer.usable(bad)  # once: a hiccup
                router.engines._no_answer(bad)
                answered = await asyncio.wait_for(waiting, 5)
                assert answered.status_code == 200, answered.text
                assert hits == [200] and spied["timed_out"] == 0
                assert not router.balancer.usable(bad)
                assert router.parts.waiting.give_up(bad, "again") == 0  # nothing left behind
                await until("the engine to see its request abandoned", lambda: cut_off.closed == 1)
            await router.close()

    run(go())
