"""The router in-process: whole snapshots swapped atomically, retries before the first byte."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelfleet.http.serving import Listener
from modelfleet.messages.wire import RoutedModel, RoutingSnapshot
from modelfleet.router.config import RouterConfig
from modelfleet.router.service import Router, create_apps

from .router_kit import client_of, keyed, serving


def snap(version: int, epoch: int = 1, **models: list[str]) -> str:
    routed = [RoutedModel(name=n, endpoints=e) for n, e in models.items()]
    return RoutingSnapshot(
        epoch=epoch, version=version, catalog_version=version, models=routed
    ).model_dump_json()


def test_the_router_takes_newer_snapshots_whole_and_ignores_older_ones() -> None:
    config = RouterConfig(
        push_token="push-token",
        api_keys=[{"name": "k", "key": "client-key"}],
        models=[RoutedModel(name="seeded", endpoints=["http://127.0.0.1:9"])],
    )
    router = Router(config)
    client_app, push_app = create_apps(router)

    async def go() -> None:
        push = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=push_app),
            base_url="http://push",
            headers={"authorization": "Bearer push-token"},
        )
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=client_app),
            base_url="http://router",
            headers={"authorization": "Bearer client-key"},
        )
        models = await client.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["seeded"]  # served before any push
        # Before its first push it cannot know a model is unknown: 503 to retry, never 404.
        early = await client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        held = (await push.get("/v1/routing/held")).json()
        assert held == {"applied": False, "epoch": 0, "version": 0}

        assert (await push.put("/v1/routing", content=snap(5, a=["http://e1"]))).status_code == 200
        taken = router.table  # what a request in flight holds
        r = await push.put("/v1/routing", content=snap(7, b=["http://e2"], c=[]))
        assert r.json() == {"applied": True, "epoch": 1, "version": 7}
        older = await push.put("/v1/routing", content=snap(6, a=["http://e1"]))
        assert older.status_code == 409
        assert older.json() == {"applied": False, "epoch": 1, "version": 7}
        assert sorted(router.table.models) == ["b", "c"]
        assert dict(taken.models) == {"a": ("http://e1",)}  # a swap never edits a held table
        assert (await push.get("/v1/routing/held")).json()["applied"] is True

        bad = await push.put("/v1/routing", content=b'{"version": -1}')
        assert bad.status_code == 400 and router.table.version == 7
        wrong = await push.put(
            "/v1/routing", content=snap(9), headers={"authorization": "Bearer x"}
        )
        assert wrong.status_code == 401 and router.table.version == 7
        # A restarted control plane counts versions afresh in a new epoch: taken.
        restarted = await push.put("/v1/routing", content=snap(1, epoch=2, b=[], c=[]))
        assert restarted.status_code == 200 and router.snapshot.epoch == 2
        stale = await push.put("/v1/routing", content=snap(8, epoch=1, a=["http://e1"]))
        assert stale.status_code == 409 and router.snapshot.epoch == 2

        gone = await client.post(
            "/v1/chat/completions", json={"model": "a", "messages": [{"role": "user"}]}
        )
        assert gone.status_code == 404
        empty = await client.post(
            "/v1/chat/completions", json={"model": "c", "messages": [{"role": "user"}]}
        )
        assert empty.status_code == 503 and empty.headers["retry-after"] == "1"
        await push.aclose()
        await client.aclose()

    asyncio.run(go())


def test_every_listener_turns_nagle_off() -> None:
    """With Nagle's algorithm on, a kept-alive client waits about 40 ms for each answer."""
    listener = Listener("any", app=None)
    sock = listener.bind()
    try:
        sock.setblocking(True)
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5):
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                assert accepted.proto == socket.IPPROTO_TCP  # what asyncio looks for
    finally:
        sock.close()


def test_a_body_over_the_limit_gets_413_before_it_is_read() -> None:
    router = keyed(max_body_bytes=1000)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):
            sent += 1
            yield b"x" * 100

    async def go() -> None:
        async with client_of(router) as client:
            r = await client.post("/v1/completions", content=body())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    asyncio.run(go())
    assert sent < 20  # it stopped reading at the limit


@pytest.mark.usefixtures("way")
def test_every_answer_is_openai_style_and_carries_its_request_id() -> None:
    async def go() -> None:
        seen: list[str | None] = []

        async def complete(request: Request) -> Response:
            seen.append(request.headers.get("x-request-id"))
            return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})

        app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])
        async with serving(app) as engine:
            router = keyed(models=[RoutedModel(name="m", endpoints=[engine])])
            async with client_of(router) as client:
                unknown = await client.get("/v1/nope")
                assert (
                    unknown.status_code == 404
                    and "Unknown path" in unknown.json()["error"]["message"]
                )
                wrong = await client.get("/v1/completions")
                assert wrong.status_code == 405 and wrong.json()["error"]["type"]
                card = await client.get("/v1/models/m")
                assert card.status_code == 200 and card.json()["id"] == "m"
                missing = await client.get("/v1/models/nope")
                assert missing.json()["error"]["code"] == "model_not_found"
                bad = await client.post(
                    "/v1/completions", json={"model": "m", "prompt": "x", "stream": "yes"}
                )
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
                given = await client.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": "x"},
                    headers={"x-request-id": "req-42"},
                )
                assert given.headers["x-request-id"] == "req-42"
                made = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert len(made.headers["x-request-id"]) == 32
            await router.close()
        assert seen == ["req-42", made.headers["x-request-id"]]

    asyncio.run(go())


def test_the_scrapes_of_several_workers_sum_to_one() -> None:
    """Counts and histogram buckets add up; a `_created` time keeps the earliest."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from modelfleet.router.metrics import summed

    texts = []
    for requests, latency in ((3, 0.2), (5, 2.0)):
        registry = CollectorRegistry()
        counter = Counter("modelfleet_router_requests", "r", ["model"], registry=registry)
        counter.labels("m").inc(requests)
        histogram = Histogram("lat", "l", buckets=(1.0,), registry=registry)
        histogram.observe(latency)
        texts.append(generate_latest(registry).decode())
    got = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(summed(texts).decode())
        for s in family.samples
    }
    assert got[("modelfleet_router_requests_total", (("model", "m"),))] == 8
    assert got[("lat_bucket", (("le", "1.0"),))] == 1
    assert got[("lat_bucket", (("le", "+Inf"),))] == 2
    assert got[("lat_sum", ())] == 2.2
    created = [
        s.value
        for text in texts
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "lat_created"
    ]
    assert got[("lat_created", ())] == min(created)


def test_a_worker_restarted_or_stalled_counts_on_from_what_it_showed(tmp_path: Path) -> None:
    """Issue 41: a worker restarted after a crash counted from zero again, and one that did
    not answer was left out of the sum: the router's counters went back."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from modelfleet.router.metrics import WorkerCounts, last_shown

    def run(requests: int, in_flight: int) -> bytes:
        registry = CollectorRegistry()
        Counter("req", "r", ["model"], registry=registry).labels("m").inc(requests)
        Histogram("lat", "l", buckets=(1.0,), registry=registry).observe(0.5)
        Gauge("in_flight", "f", registry=registry).set(in_flight)
        return generate_latest(registry)

    def samples(text: bytes | str) -> dict[str, float]:
        page = text.decode() if isinstance(text, bytes) else text
        families = text_string_to_metric_families(page)
        return {s.name: s.value for f in families for s in f.samples if "_created" not in s.name}

    path = tmp_path / "worker-0.counts"
    assert last_shown(path) is None  # never scraped: nothing to stand in for it
    first = samples(WorkerCounts(path).shown(run(5, 3)))
    assert (first["req_total"], first["lat_count"], first["in_flight"]) == (5, 1, 3)
    # Stalled: what it showed stands in for it, its gauges (no longer known) left out.
    assert samples(last_shown(path) or "") == {"req_total": 5, "lat_bucket": 1, "lat_count": 1,
                                               "lat_sum": 0.5}  # fmt: skip
    # Restarted (a new run, its counters from zero): it goes on from what its runs showed.
    again = WorkerCounts(path)
    assert samples(again.shown(run(2, 1))) == {"req_total": 7, "lat_bucket": 2, "lat_count": 2,
                                                "lat_sum": 1.0, "in_flight": 1}  # fmt: skip
    assert samples(WorkerCounts(path).shown(run(1, 0)))["req_total"] == 8  # and again
