"""The engine simulator in-process, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app

from .router_kit import serving


def client(**kw: object) -> httpx.AsyncClient:
    settings = SimSettings(**{"model": "m", "ttft": 0.0, "itl": 0.0, **kw})  # type: ignore[arg-type]
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(settings)), base_url="http://sim"
    )


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_chat_and_completion_fill_in_usage() -> None:
    async def go() -> None:
        async with client() as c:
            chat = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": [{"role": "user", "content": "a b c"}],
                    "max_tokens": 3,
                },
            )
            assert chat.status_code == 200
            body = chat.json()
            assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
            assert len(body["choices"][0]["message"]["content"].split()) == 3
            assert body["choices"][0]["finish_reason"] == "length"
            done = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert done.json()["usage"]["completion_tokens"] == 16  # the default output length
            assert done.json()["object"] == "text_completion"

    run(go())


def test_stream_is_server_sent_events_ending_in_done() -> None:
    async def go() -> None:
        async with client() as c:
            body = {
                "model": "m",
                "prompt": "hi",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await c.post("/v1/completions", json=body)
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert (
                "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).split().__len__()
                == 2
            )
            assert chunks[-1]["usage"]["completion_tokens"] == 2

    run(go())


def test_bad_requests_are_openai_errors() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/chat/completions", content=b"{nope")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await c.post(
                "/v1/chat/completions", json={"model": "other", "messages": [{"content": "x"}]}
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"

    run(go())


def test_concurrency_limit_queues_and_metrics_use_vllm_names() -> None:
    async def go() -> None:
        # A first token that takes an hour: the three requests stay running or waiting while
        # the metrics are read, however slow this machine is.
        settings = SimSettings(model="m", ttft=3600, itl=0.0, max_concurrency=1)
        app = create_app(settings)
        engine = app.state.engine
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://sim"
        ) as c:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            requests = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(3)]
            deadline = asyncio.get_running_loop().time() + 10
            while (engine.running, engine.waiting) != (1, 2):
                assert asyncio.get_running_loop().time() < deadline, (
                    f"waited for 1 running and 2 waiting, have {engine.running}, {engine.waiting}"
                )
                await asyncio.sleep(0.01)
            metrics = (await c.get("/metrics")).text
            assert 'vllm:num_requests_running{model_name="m"} 1.0' in metrics
            assert 'vllm:num_requests_waiting{model_name="m"} 2.0' in metrics
            # The running one holds its prompt (one token) in the KV cache; the others none.
            used = 1 / settings.kv_cache_tokens
            assert f'vllm:kv_cache_usage_perc{{model_name="m"}} {used}' in metrics
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)

    run(go())


def test_metrics_count_tokens_and_requests() -> None:
    async def go() -> None:
        async with client(max_concurrency=1) as c:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            done = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3)))
            assert all(r.status_code == 200 for r in done)
            metrics = (await c.get("/metrics")).text
            assert 'vllm:generation_tokens_total{model_name="m"} 3.0' in metrics
            assert 'vllm:prompt_tokens_total{model_name="m"} 3.0' in metrics
            assert 'vllm:num_requests_running{model_name="m"} 0.0' in metrics
            assert (await c.get("/health")).status_code == 200
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m"]

    run(go())


def test_metrics_hold_vllm_s_histograms_of_time_to_first_token_and_between_tokens() -> None:
    """Issue 57: the README said the simulator served these; it served neither. As vLLM's:
    the time to first token from the request's arrival (its wait for a slot included), and
    one observation per gap between two tokens of a request."""
    from prometheus_client.parser import text_string_to_metric_families

    async def go() -> None:
        async with client(max_concurrency=1, ttft=0.05, itl=0.03) as c:
            body = {"model": "m", "prompt": "x", "max_tokens": 3}
            done = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2)))
            assert all(r.status_code == 200 for r in done)
            page = (await c.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(page)}
        first = families["vllm:time_to_first_token_seconds"]
        between = families["vllm:inter_token_latency_seconds"]
        assert first.type == between.type == "histogram"

        def value(family: object, name: str, **labels: str) -> float:
            return next(s.value for s in family.samples  # type: ignore[attr-defined]
                        if s.name == name and labels.items() <= s.labels.items())  # fmt: skip

        name = "vllm:time_to_first_token_seconds"
        assert value(first, f"{name}_count", model_name="m") == 2
        assert value(first, f"{name}_bucket", le="0.04") == 0  # none sooner than its ttft
        # The second waited for the first (0.05 + 2 x 0.03) before its own 0.05: past 0.1 s.
        assert value(first, f"{name}_bucket", le="0.1") == 1
        assert value(first, f"{name}_sum") >= 0.05 + 0.16
        name = "vllm:inter_token_latency_seconds"
        assert value(between, f"{name}_count") == 4  # two gaps of each answer of three tokens
        assert value(between, f"{name}_bucket", le="0.025") == 0
        assert value(between, f"{name}_sum") >= 4 * 0.03

    run(go())


def test_more_than_one_choice_is_refused_not_answered_with_one() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            one = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 1})
            assert one.status_code == 200

    run(go())


def test_what_it_cannot_honour_is_refused_naming_the_field() -> None:
    """Once answered with 200 as if honoured: `temperature: "hot"`, `stream_options: 5`,
    `tool_choice: required` (answered in plain text), `response_format: json_object`,
    `logprobs`; `/v1/embeddings` was a text/plain 404."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    refused = [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": -1}, "top_p"),
        ({"stream": True, "stream_options": 5}, "stream_options"),
        ({"tools": tools, "tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"stop": 5}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2}, "n"),
    ]  # fmt: skip

    async def go() -> None:
        async with client() as c:
            for extra, param in refused:
                answer = await c.post("/v1/chat/completions", json={**chat, **extra})
                assert answer.status_code == 400, (extra, answer.text)
                assert answer.json()["error"]["param"] == param, extra
            fine = {"temperature": 0.7, "tools": tools, "tool_choice": "auto", "seed": 3}
            assert (await c.post("/v1/chat/completions", json={**chat, **fine})).is_success
            embedded = await c.post("/v1/embeddings", json={"model": "m", "input": "x"})
            assert embedded.status_code == 400
            assert embedded.json()["error"]["code"] == "model_not_supported"
            unknown = await c.post("/v1/nowhere", json={})
            assert unknown.status_code == 404 and "error" in unknown.json()

    run(go())


def test_a_request_past_the_context_is_refused_at_once() -> None:
    """A 2 MB prompt once ran for 35 s; vLLM refuses past --max-model-len, in these words."""

    async def go() -> None:
        async with client(max_model_len=100) as c:
            long = {"model": "m", "prompt": "word " * 200, "max_tokens": 5}
            answer = await c.post("/v1/completions", json=long)
            assert answer.status_code == 400
            assert "maximum context length is 100 tokens" in answer.json()["error"]["message"]
            over = {"model": "m", "prompt": "a b c", "max_tokens": 98}
            assert (await c.post("/v1/completions", json=over)).status_code == 400
            fits = {"model": "m", "prompt": "a b c", "max_tokens": 97}
            assert (await c.post("/v1/completions", json=fits)).status_code == 200
            # Naming no max_tokens, it gets what the context has room for.
            room = {"model": "m", "prompt": "word " * 90}
            answer = await c.post("/v1/completions", json=room)
            assert answer.json()["usage"]["completion_tokens"] == 10

    run(go())


def test_a_chat_streams_role_comes_with_its_first_token() -> None:
    """The role event went out at once, before any token: a router's time to first byte read
    under 5 ms where clients waited 55 ms for their first token. Served on loopback, so that
    each write of the simulator arrives as it was made."""

    async def go() -> None:
        settings = SimSettings(model="m", ttft=0.3, itl=0.0)
        async with serving(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, "stream": True}  # fmt: skip
            began = time.monotonic()
            async with c.stream("POST", "/v1/chat/completions", json=body) as answer:
                async for chunk in answer.aiter_bytes():
                    first, waited = chunk, time.monotonic() - began
                    break
            events = [json.loads(e[6:]) for e in first.decode().split("\n\n") if e]
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[1]["choices"][0]["delta"]["content"]  # the first token, together
            assert waited >= 0.3  # nothing came before the first token was made

    run(go())


def test_sleep_mode_lets_running_requests_end_refuses_while_asleep_and_wakes_after_its_delay() -> (
    None
):
    """vLLM's sleep endpoints, as the sleeping tier uses them: a sleep asked for while a
    request runs lets it end whole, then the engine sleeps; requests meanwhile get 503; a wake
    takes the wake delay (twice it from level 2); without --enable-sleep-mode there are no
    such endpoints."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5}

    async def go() -> None:
        async with client(sleep_mode=True, sleep_delay=0.05, wake_delay=0.1, itl=0.02) as c:
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False}
            running = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat))
            await asyncio.sleep(0.02)  # it has started
            slept = await c.post("/sleep", params={"level": "1"})
            assert slept.status_code == 200
            done = await running
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 5
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
            refused = await c.post("/v1/chat/completions", json=chat)
            assert refused.status_code == 503 and "asleep" in refused.text
            asked = time.monotonic()
            assert (await c.post("/wake_up")).status_code == 200
            assert time.monotonic() - asked >= 0.1
            assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
            assert (await c.post("/sleep", params={"level": "3"})).status_code == 400
            assert (await c.post("/sleep", params={"level": "2"})).status_code == 200
            asked = time.monotonic()
            assert (await c.post("/wake_up")).status_code == 200
            assert time.monotonic() - asked >= 0.2  # the weights reload
        async with client() as plain:
            assert (await plain.post("/sleep")).status_code == 404

    run(go())


def test_lora_adapters_load_after_a_delay_are_listed_with_their_base_and_the_least_used_goes(
    tmp_path: object,
) -> None:
    async def go() -> None:
        async with client(enable_lora=True, max_loras=2, lora_load_delay=0.2) as c:

            def ask(model: str) -> Any:
                body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
                return c.post("/v1/chat/completions", json=body)

            assert (await ask("a1")).status_code == 404  # not held: vLLM's 404
            began = time.monotonic()
            loaded = await c.post(
                "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "org/a1"}
            )
            assert loaded.status_code == 200 and time.monotonic() - began >= 0.2
            again = await c.post(
                "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "org/a1"}
            )
            assert again.status_code == 400 and "already been loaded" in again.text
            answer = await ask("a1")
            assert answer.status_code == 200 and answer.json()["model"] == "a1"

            listed = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m.get("parent")) for m in listed] == [("m", None), ("a1", "m")]

            await c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "x/a2"})
            assert (await ask("a1")).status_code == 200  # a1 used after a2 was loaded
            await c.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "x/a3"})
            held = [m["id"] for m in (await c.get("/v1/models")).json()["data"][1:]]
            assert held == ["a1", "a3"]  # a2, the least recently used, was let go
            assert (await ask("a2")).status_code == 404

            missing = await c.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "gone", "lora_path": "/no/such/adapter"},
            )
            assert missing.status_code == 400 and "No adapter found" in missing.text
            out = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
            assert out.status_code == 200
            out = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
            assert out.status_code == 404

    run(go())


def test_output_is_bounded_as_vllm_bounds_it() -> None:
    """A chat's null `max_completion_tokens` once made the simulator ignore `max_tokens`
    (16 tokens for a request of 5), and a completion's `max_completion_tokens` was honoured
    over its `max_tokens`, which vLLM's completions ignore. Neither bound: the model's length."""

    async def go() -> None:
        async with client(output_tokens=10_000, max_model_len=40) as c:
            chat = {"model": "m", "messages": [{"role": "user", "content": "a b"}]}
            for fields, used in (
                ({"max_completion_tokens": None, "max_tokens": 5}, 5),
                ({"max_completion_tokens": 7, "max_tokens": 5}, 7),
                ({"max_completion_tokens": None}, 40 - 2),  # the rest of the model's length
                ({}, 40 - 2),
            ):
                answer = await c.post("/v1/chat/completions", json={**chat, **fields})
                assert answer.json()["usage"]["completion_tokens"] == used, fields
            done = await c.post(
                "/v1/completions",
                json={"model": "m", "prompt": "a b", "max_completion_tokens": 30, "max_tokens": 3},
            )
            assert done.json()["usage"]["completion_tokens"] == 3
            done = await c.post(
                "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": None}
            )
            assert done.json()["usage"]["completion_tokens"] == 40 - 2

    run(go())


def test_a_lone_surrogate_in_a_prompt_is_answered_not_a_500() -> None:
    """Found by an outside attack: `"prompt": "\\ud800"` (JSON may carry a lone surrogate)
    made the simulator fail with UnicodeEncodeError, a 500 and a traceback per request."""

    async def go() -> None:
        async with client(prefix_cache_blocks=8) as c:
            for path, body in (
                ("/v1/completions", {"prompt": "a \ud800 b" * 20, "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}),
            ):
                raw = json.dumps({"model": "m", **body}).encode()  # ASCII: the escape as sent
                got = await c.post(path, content=raw, headers={"content-type": "application/json"})
                assert got.status_code == 200, got.text

    run(go())
