"""The router's data path against engines served on 127.0.0.1: retries before the first byte,
timeouts, ejection, stalled streams, clients that go away, the max_tokens cap, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from modelfleet.messages.wire import RoutedModel
from modelfleet.router.proxy import asking_usage
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator

from .router_kit import (
    FakeClock,
    client_of,
    keyed,
    router_url,
    run,
    serving,
    until,
    upstream,
)

COMPLETION = {"model": "m", "prompt": "x"}


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_failing_replica_is_retried_elsewhere_then_ejected_and_probed_back(status: int) -> None:
    """Each request that meets the failing engine first is answered by the healthy one; after
    three failures in a row the failing engine gets no more requests until a probe of it
    succeeds, and a second ejection lasts twice as long."""
    clock = FakeClock()

    async def go() -> None:
        failing: list[int] = []
        healthy: list[int] = []
        async with upstream(status, failing) as bad, upstream(200, healthy) as good:
            ids = {bad: "m-bad", good: "m-good"}
            routed = RoutedModel(name="m", endpoints=[bad, good], replicas=ids)
            router = keyed(clock, models=[routed])
            async with client_of(router) as client:
                for _ in range(200):
                    r = await client.post("/v1/completions", json=COMPLETION)
                    assert r.status_code == 200, r.text
                    if len(failing) == 3:
                        break
                assert len(failing) == 3, f"the failing engine was tried {len(failing)} times"
                assert not router.balancer.usable(bad)
                # The control plane hears which replica is out, and why (`ctl events`).
                [(rid, out)] = router.load_now().ejected.items()
                assert (rid, out.left_s, out.times) == ("m-bad", 5.0, 1)
                assert out.why == f"3 failures in a row, the last: HTTP {status}"
                answered = len(healthy)
                for _ in range(10):  # ejected: never tried
                    assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                assert len(failing) == 3 and len(healthy) == answered + 10

                await router.engines.watch_once()  # not yet time to probe it
                assert not router.balancer.usable(bad)
                clock.now += 5
                await router.engines.watch_once()  # its /health answers 200: back in rotation
                assert router.balancer.usable(bad)
                assert router.load_now().ejected == {}
                while len(failing) < 6:
                    assert (await client.post("/v1/completions", json=COMPLETION)).is_success
                assert router.balancer.state[bad].ejected_until == clock.now + 10

                page = (await router.metrics_text()).decode()
                assert f'modelfleet_router_ejections_total{{endpoint="{bad}"}} 2.0' in page
                assert 'modelfleet_router_retries_total{model="m"} 6.0' in page
            await router.close()

    run(go())


def hanging_engine(calls: list[str], gone: list[str]) -> Starlette:
    """An engine that takes every completion and never answers; it notes each request that
    its client gave up (the connection closed)."""

    async def complete(request: Request) -> Response:
        calls.append("called")
        await request.body()
        await request.receive()  # returns once the client has disconnected
        gone.append("gone")
        return Response(status_code=499)

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


@pytest.mark.usefixtures("way")
def test_a_replica_silent_past_the_models_first_byte_timeout_is_left_for_another() -> None:
    async def go() -> None:
        calls: list[str] = []
        gone: list[str] = []
        healthy: list[int] = []
        async with serving(hanging_engine(calls, gone)) as slow, upstream(200, healthy) as good:
            router = keyed(
                models=[
                    RoutedModel(name="m", endpoints=[slow, good], first_byte_timeout=0.2),
                    RoutedModel(name="only-slow", endpoints=[slow], first_byte_timeout=0.2),
                ]
            )
            async with client_of(router) as client:
                while not calls:
                    r = await client.post("/v1/completions", json=COMPLETION)
                    assert r.status_code == 200, r.text
                late = await client.post(
                    "/v1/completions", json={"model": "only-slow", "prompt": "x"}
                )
                assert late.status_code == 504, late.text
                assert late.headers["x-modelfleet-reason"] == "first-byte-timeout"
                assert late.json()["error"]["code"] == "upstream_timeout"
                # Each request the router gave up on was given up on at the engine too.
                await until("the engine to see both requests abandoned", lambda: len(gone) == 2)
            await router.close()

    run(go())


def stalling_engine() -> Starlette:
    """An engine whose stream sends one token and then nothing, forever."""

    async def complete(_: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
            chunk["choices"] = [{"index": 0, "text": " one", "finish_reason": None}]
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.Event().wait()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


@pytest.mark.usefixtures("way")
def test_a_stalled_stream_ends_with_an_error_event_never_silence() -> None:
    async def go() -> None:
        async with serving(stalling_engine()) as engine:
            router = keyed(chunk_timeout=0.3, models=[RoutedModel(name="m", endpoints=[engine])])
            http = client_of(router)
            sdk = openai.AsyncOpenAI(
                api_key="client-key", base_url="http://router/v1", http_client=http
            )
            stream = await sdk.completions.create(model="m", prompt="x", stream=True)
            texts = []
            with pytest.raises(openai.APIError, match="stopped answering mid-stream"):
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
            assert texts == [" one"]
            await http.aclose()
            await router.close()

    run(go())


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_the_request_upstream(stream: bool) -> None:
    """A request with a huge max_tokens whose client leaves no longer holds the engine. A
    short request first leaves a kept-alive connection to the engine, so that the long one is
    sent by callbacks (the lean server's way) or from the request's task (ASGI's)."""

    async def go() -> None:
        sim = create_simulator(SimSettings(model="m", ttft=0.0, itl=0.05))
        engine = sim.state.engine
        async with serving(sim) as engine_url:
            router = keyed(models=[RoutedModel(name="m", endpoints=[engine_url])])
            async with router_url(router) as url:
                body = {"model": "m", "prompt": "x", "max_tokens": 8_000, "stream": stream}
                headers = {"authorization": "Bearer client-key"}
                async with httpx.AsyncClient(base_url=url, headers=headers) as client:
                    short = {"model": "m", "prompt": "x", "max_tokens": 1}
                    assert (await client.post("/v1/completions", json=short)).is_success
                    if stream:
                        async with client.stream("POST", "/v1/completions", json=body) as r:
                            async for _ in r.aiter_bytes():
                                break  # one chunk read, then the client leaves
                    else:
                        request = asyncio.create_task(client.post("/v1/completions", json=body))
                        await until("the engine to run the request", lambda: engine.running == 1)
                        request.cancel()
                        with pytest.raises(asyncio.CancelledError):
                            await request
                    await until(
                        "the engine to count the request cancelled",
                        lambda: engine.cancelled_total == 1 and engine.running == 0,
                    )
                    page = (await router.metrics_text()).decode()
                    assert 'modelfleet_router_client_disconnects_total{model="m"} 1.0' in page
            await router.close()

    run(go())


def echo_engine(seen: list[dict[str, object]]) -> Starlette:
    async def complete(request: Request) -> Response:
        seen.append(await request.json())
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


@pytest.mark.usefixtures("way")
def test_the_catalogs_max_tokens_cap_refuses_or_clamps() -> None:
    async def go() -> None:
        seen: list[dict[str, object]] = []
        async with serving(echo_engine(seen)) as engine:
            router = keyed(
                models=[
                    RoutedModel(name="strict", endpoints=[engine], max_tokens_cap=100),
                    RoutedModel(
                        name="lenient",
                        endpoints=[engine],
                        max_tokens_cap=100,
                        max_tokens_over_cap="clamp",
                    ),
                ]
            )
            async with client_of(router) as client:
                over = await client.post(
                    "/v1/completions", json={"model": "strict", "prompt": "x", "max_tokens": 500}
                )
                assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
                assert "cap of 100" in over.json()["error"]["message"] and not seen
                for model, asked in (("strict", 50), ("strict", None), ("lenient", 500)):
                    body = {"model": model, "prompt": "x"}
                    if asked is not None:
                        body["max_tokens"] = asked
                    assert (await client.post("/v1/completions", json=body)).is_success
                chat_over = await client.post(
                    "/v1/chat/completions",
                    json={"model": "strict", "messages": [], "max_completion_tokens": 101},
                )
                assert chat_over.json()["error"]["param"] == "max_completion_tokens"
            await router.close()
        assert [s["max_tokens"] for s in seen] == [50, 100, 100]

    run(go())


@pytest.mark.usefixtures("way")
def test_answers_name_their_replica_and_metrics_move() -> None:
    async def go() -> None:
        healthy: list[int] = []
        async with upstream(200, healthy) as engine:
            router = keyed(
                models=[
                    RoutedModel(name="m", endpoints=[engine], replicas={engine: "m-r1"}),
                    RoutedModel(name="none-ready", endpoints=[]),
                ]
            )
            async with client_of(router) as client:
                for _ in range(3):
                    r = await client.post("/v1/completions", json=COMPLETION)
                    assert r.headers["x-modelfleet-replica"] == "m-r1"
                busy = await client.post(
                    "/v1/completions", json={"model": "none-ready", "prompt": "x"}
                )
                assert busy.status_code == 503
                assert busy.headers["x-modelfleet-reason"] == "no-ready-replica"
                page = (await router.metrics_text()).decode()
            await router.close()
        assert 'modelfleet_router_requests_total{model="m",status="200"} 3.0' in page
        assert 'modelfleet_router_requests_total{model="none-ready",status="503"} 1.0' in page
        refused = 'model="none-ready",reason="no-ready-replica",status="503"'
        assert f"modelfleet_router_refusals_total{{{refused}}} 1.0" in page
        # Refused, it is kept out of the times: only requests an engine answered are in them.
        assert "modelfleet_router_overhead_seconds_count 3.0" in page
        assert 'modelfleet_router_request_seconds_count{model="none-ready"}' not in page
        assert 'modelfleet_router_first_byte_seconds_count{model="m"} 3.0' in page
        assert f'modelfleet_router_in_flight{{endpoint="{engine}"}} 0.0' in page

    run(go())


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


@given(
    extra=st.dictionaries(
        st.text(max_size=8).filter(lambda k: k not in ("model", "stream", "stream_options")),
        _JSON_VALUES,
        max_size=4,
    ),
    options=st.none() | st.dictionaries(st.sampled_from(["include_usage", "x"]), st.booleans()),
    indent=st.sampled_from([None, 2]),
)
def test_asking_usage_gives_the_same_request_with_usage_asked(
    extra: dict[str, object], options: dict[str, bool] | None, indent: int | None
) -> None:
    """Spliced into the raw body or encoded anew, the engine gets the client's request with
    `stream_options.include_usage` true and nothing else changed."""
    body: dict[str, object] = {**extra, "model": "m", "stream": True}
    if options is not None:
        body["stream_options"] = options
    raw = (json.dumps(body, indent=indent) + "\n").encode()
    parsed = json.loads(raw)
    sent = json.loads(asking_usage(parsed, raw))
    want = {**body, "stream_options": {**(options or {}), "include_usage": True}}
    assert sent == want


@pytest.mark.usefixtures("way")
def test_a_stream_s_time_between_tokens_is_a_histogram_of_its_own() -> None:
    """Issue 41: the vLLM board shows inter-token latency; the router measured none. One
    observation per stream of two tokens or more: its time after the first byte over its
    tokens but one. A whole (not streamed) answer has no time between tokens to see."""

    async def go() -> None:
        simulator = create_simulator(SimSettings(model="m", ttft=0, itl=0.02))
        async with serving(simulator) as engine:
            router = keyed(models=[RoutedModel(name="m", endpoints=[engine])])
            async with client_of(router) as client:
                body = {**COMPLETION, "max_tokens": 6}
                assert (await client.post("/v1/completions", json=body)).is_success
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
                assert streamed.text.rstrip().endswith("data: [DONE]")
                page = (await router.metrics_text()).decode()
            await router.close()
        count = 'modelfleet_router_inter_token_seconds_count{model="m"} 1.0'
        assert count in page, page
        [gap] = [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith('modelfleet_router_inter_token_seconds_sum{model="m"}')
        ]
        assert 0.015 <= gap < 0.5  # about the simulator's 20 ms a token

    run(go())


@pytest.mark.usefixtures("way")
def test_the_load_a_router_reports_has_each_replica_s_engine_queue_and_kv_cache() -> None:
    """Issue 41: queue depth and KV-cache use per replica, read from the engines, for the
    control plane to show."""

    async def go() -> None:
        simulator = create_simulator(SimSettings(model="m", ttft=3600, itl=0))
        async with serving(simulator) as engine:
            routed = RoutedModel(name="m", endpoints=[engine], replicas={engine: "m-r1"})
            router = keyed(models=[routed])
            async with client_of(router) as client:
                asked = asyncio.create_task(
                    client.post("/v1/completions", json={**COMPLETION, "prompt": "a b c d"})
                )
                await until("the request at the engine", lambda: simulator.state.engine.running)
                await router.engines.watch_once()
                load = router.load_now().models["m"]
                asked.cancel()
                await asyncio.gather(asked, return_exceptions=True)
            await router.close()
        assert load.replicas["m-r1"][1] == 1  # running at its engine
        assert 0 < load.cache["m-r1"] < 0.01  # its prompt's four tokens of 32,768

    run(go())
