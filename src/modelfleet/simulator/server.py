"""The engine simulator's HTTP face: an OpenAI-compatible server that behaves like vLLM.

`GET /health`, `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (streaming
as server-sent events ending in `data: [DONE]`, or whole), and `GET /metrics` with vLLM's metric
names. On SIGTERM it stops accepting, finishes the requests in flight, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelfleet.core.nesting import check_json
from modelfleet.http.openai_api import (
    BadRequest,
    check_generation,
    error_response,
    parse_body,
    prompt_text,
)
from modelfleet.http.serving import Listener, run_service
from modelfleet.http.tracing import (
    TRACEPARENT,
    SpanRecord,
    SpanSink,
    new_span_id,
    parse_traceparent,
)
from modelfleet.http.web import bearer_matches, json_response
from modelfleet.simulator.checks import check_request
from modelfleet.simulator.engine import LoraRefused, SimEngine, SimSettings, count_prompt_tokens


class _VllmMetrics:
    """A Prometheus collector reading the engine's counters at scrape time, in vLLM's names."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e, labels = self.engine, [self.engine.settings.model]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests decoding now.", e.running),
            ("vllm:num_requests_waiting", "Requests waiting for a slot.", e.waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                min(1.0, e.kv_tokens / e.settings.kv_cache_tokens),
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens processed.", e.prompt_tokens_total),
            ("vllm:generation_tokens", "Tokens generated.", e.generation_tokens_total),
            ("vllm:request_success", "Requests finished.", e.requests_total),
            ("sim:requests_cancelled", "Requests given up by their client.", e.cancelled_total),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up.", e.prefix_cache.queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached.", e.prefix_cache.hits),
            ("sim:lora_loads", "LoRA adapters loaded since the start.", e.adapters.loads),
            ("sim:lora_evictions", "Adapters let go to make room.", e.adapters.evicted),
            ("sim:busy_seconds", "Seconds with a request running.", e.busy_seconds()),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        for name, doc, times in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             e.first_token),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             e.inter_token),
        ):  # fmt: skip
            histogram = HistogramMetricFamily(name, doc, labels=["model_name"])
            histogram.add_metric(labels, times.cumulative(), times.sum)
            yield histogram


class _HangAfter:
    """From `at` (monotonic) on, every request waits forever: the engine hangs, still running."""

    def __init__(self, app: ASGIApp, at: float) -> None:
        self.app = app
        self.at = at

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and time.monotonic() >= self.at:
            await asyncio.Event().wait()
        await self.app(scope, receive, send)


class _Traced:
    """Each request that comes with a `traceparent` gets the engine's span, its child, from
    the first byte in to the last byte out (a stream's last event included)."""

    def __init__(self, app: ASGIApp, sink: SpanSink, model: str) -> None:
        self.app = app
        self.sink = sink
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parent = None
        if scope["type"] == "http":
            parent = parse_traceparent(dict(scope["headers"]).get(TRACEPARENT))
        if parent is None or not parent.sampled:
            await self.app(scope, receive, send)
            return
        began = time.time_ns()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.sink.record(
                SpanRecord(
                    name=f"engine {scope['path']}",
                    trace_id=parent.trace_id,
                    span_id=new_span_id(),
                    parent_id=parent.span_id,
                    start_ns=began,
                    end_ns=time.time_ns(),
                    kind="server",
                    attributes={
                        "gen_ai.request.model": self.model,
                        "http.response.status_code": status,
                    },
                    error=f"HTTP {status}" if status >= 500 or status == 0 else None,
                )
            )


class _KeyRequired:
    """Every /v1 request must carry the engine's key, as vLLM's `--api-key` asks; /health and
    /metrics stay open, as they are on vLLM."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            sent = headers.get(b"authorization", b"").decode(errors="replace")
            if not bearer_matches(sent, self.key):
                refused = error_response(
                    401, "This engine needs its key.", "invalid_request_error", "invalid_api_key"
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: SimSettings) -> Starlette:
    """The simulator as an ASGI app (tests can drive it in-process)."""
    engine = SimEngine(settings)
    registry = CollectorRegistry()
    registry.register(_VllmMetrics(engine))
    created = int(time.time())

    async def health(_: Request) -> Response:
        if settings.fault == "never-ready":
            return Response(b"still loading (simulated fault: never-ready)\n", status_code=503)
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        card = {"id": settings.model, "object": "model", "created": created, "owned_by": "sim"}
        # Adapters as vLLM lists them: each with its base model as `parent`.
        adapters = [
            {"id": name, "object": "model", "created": created, "owned_by": "sim",
             "root": source, "parent": settings.model}
            for name, source in engine.adapters.held.items()
        ]  # fmt: skip
        return json_response({"object": "list", "data": [card, *adapters]})

    async def load_lora(request: Request) -> Response:
        try:
            raw = await request.body()
            check_json(raw)  # TooDeep is a ValueError: refused below
            body = json.loads(raw)
            name, source = body["lora_name"], body["lora_path"]
            if not (isinstance(name, str) and isinstance(source, str) and name and source):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return error_response(
                400, "the body must name lora_name and lora_path", "invalid_request_error"
            )
        try:
            await engine.adapters.load(name, source)
        except LoraRefused as exc:
            return error_response(exc.status, str(exc), "invalid_request_error")
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        try:
            raw = await request.body()
            check_json(raw)
            name = json.loads(raw)["lora_name"]
        except (ValueError, KeyError, TypeError):
            return error_response(400, "the body must name lora_name", "invalid_request_error")
        try:
            engine.adapters.unload(str(name))
        except LoraRefused as exc:
            return error_response(exc.status, str(exc), "invalid_request_error")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def chat(request: Request) -> Response:
        return await _complete(request, engine, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, engine, chat=False)

    async def embeddings(_: Request) -> Response:
        return error_response(
            400,
            f"The model `{settings.model}` does not support the Embeddings API: this engine "
            "simulates a generative model.",
            "invalid_request_error",
            code="model_not_supported",
            param="model",
        )

    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            return error_response(400, f"level {level!r}: 1 or 2", "invalid_request_error")
        if engine.sleep.changing:
            return error_response(409, f"the engine is {engine.sleep.changing}", "conflict")
        await engine.fall_asleep(int(level))
        return Response(status_code=200)

    async def wake_up(_: Request) -> Response:
        if engine.sleep.changing:
            return error_response(409, f"the engine is {engine.sleep.changing}", "conflict")
        await engine.wake_up()
        return Response(status_code=200)

    async def is_sleeping(_: Request) -> Response:
        return json_response({"is_sleeping": not engine.sleep.serving})

    async def not_found(request: Request, _: Exception) -> Response:
        return error_response(
            404, f"Unknown path: {request.method} {request.url.path}", "invalid_request_error"
        )

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]
    if settings.enable_lora:  # vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING; then SGLang's
        routes += [
            Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
            Route("/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/unload_lora_adapter", unload_lora, methods=["POST"]),
        ]
    if settings.sleep_mode:  # vLLM's sleep endpoints exist only with --enable-sleep-mode
        routes += [
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping),
        ]
    sink: SpanSink | None = None
    if settings.otlp_endpoint is not None:
        from modelfleet.http.otlp import OtlpSink  # the SDK, loaded only when spans are sent

        sink = OtlpSink(settings.otlp_endpoint, "modelfleet-engine-sim")

    app = Starlette(routes=routes, exception_handlers={404: not_found})
    app.state.sink = sink  # closed when the simulator stops (`serve`): sends what it holds
    if sink is not None:
        app.add_middleware(_Traced, sink=sink, model=settings.model)
    if settings.api_key is not None:
        app.add_middleware(_KeyRequired, key=settings.api_key)
    if settings.hang_after is not None:
        app.add_middleware(_HangAfter, at=time.monotonic() + settings.hang_after)
    app.state.engine = engine
    return app


async def _complete(request: Request, engine: SimEngine, chat: bool) -> Response:
    try:
        body = parse_body(await request.body())
        check_generation(body)
        check_request(body, chat)
        prompt = prompt_text(body, chat)
        max_tokens = output_bound(body, chat)
        n_prompt = count_prompt_tokens(prompt)
        max_len = engine.settings.max_model_len
        if n_prompt + (max_tokens or 1) > max_len:
            # vLLM's own words, so that clients written against it read this one too.
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n_prompt + (max_tokens or 0)} tokens ({n_prompt} in the "
                f"messages, {max_tokens or 0} in the completion). Please reduce the length "
                "of the messages or completion.",
                param="messages" if chat else "prompt",
            )
        if max_tokens is None and engine.settings.output_tokens > max_len - n_prompt:
            max_tokens = max_len - n_prompt  # what the context has room for
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", param=exc.param)
    if not engine.sleep.serving:
        state = engine.sleep.changing or "asleep"
        return error_response(
            503, f"The engine is {state}: POST /wake_up first.", "service_unavailable"
        )
    model = body["model"]
    if model != engine.settings.model and not engine.adapters.use(model):
        return error_response(
            404,
            f"The model `{model}` does not exist; this engine serves "
            f"`{engine.settings.model}` and the adapters it holds.",
            "invalid_request_error",
            code="model_not_found",
            param="model",
        )
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "created": int(time.time()),
        "model": model,
    }
    tokens = engine.generate(prompt, max_tokens)
    if body.get("stream"):
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        events = _stream(tokens, meta, chat, n_prompt, max_tokens, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    text = await _unless_gone(request, _join(tokens))
    if text is None:
        return Response(status_code=499)  # nobody reads it: the client has gone
    n_out = len(text.split())
    finish = _finish_reason(n_out, max_tokens)
    if chat:
        message = {"role": "assistant", "content": text}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return json_response(
        {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": _usage(n_prompt, n_out),
        }
    )


async def _join(tokens: AsyncIterator[str]) -> str:
    try:
        return "".join([t async for t in tokens])
    finally:
        await tokens.aclose()  # type: ignore[attr-defined]


async def _unless_gone(request: Request, work: Coroutine[Any, Any, str]) -> str | None:
    """`work`'s result, or None once the client has disconnected: then `work` is cancelled,
    as vLLM aborts a request whose client has gone."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(request.receive())  # the body is read: next is the disconnect
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if job.cancelled() or not job.done():
        with contextlib.suppress(asyncio.CancelledError):
            await job
        return None
    return job.result()


def output_bound(body: dict[str, Any], chat: bool) -> int | None:
    """A choice's output bound as vLLM reads it: a chat's `max_completion_tokens`, or its
    `max_tokens` where that is null or absent; a completion's `max_tokens` alone (vLLM's
    completions know no `max_completion_tokens`). None: bounded by the model's length alone
    (and the simulator's `output_tokens`, where its made-up answer ends)."""
    if chat:
        bound = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        bound = body.get("max_tokens")
    return bound if isinstance(bound, int) else None


def _finish_reason(n_out: int, max_tokens: int | None) -> str:
    return "length" if max_tokens is not None and n_out >= max_tokens else "stop"


def _usage(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


async def _stream(
    tokens: AsyncIterator[str],
    meta: dict[str, Any],
    chat: bool,
    n_prompt: int,
    max_tokens: int | None,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {**meta, "object": kind, "choices": choices, **extra}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    n_out = 0
    # A chat stream's first event names the role. vLLM sends it once the first token is
    # made, not at once: sent before, it made a router's time to first byte read under 5 ms
    # where clients saw 55 ms to their first token.
    role = (
        event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if chat
        else b""
    )
    try:
        async for token in tokens:
            n_out += 1
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": token},
                    "finish_reason": None,
                }
            else:
                choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": None}
            yield role + event([choice])
            role = b""
    finally:
        await tokens.aclose()  # type: ignore[attr-defined]  # a stream cut short frees its slot
    finish = _finish_reason(n_out, max_tokens)
    last: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        last["delta"] = {}
    else:
        last.update(text="", logprobs=None)
    yield role + event([last])
    if include_usage:
        yield event([], usage=_usage(n_prompt, n_out))
    yield b"data: [DONE]\n\n"


async def serve(
    settings: SimSettings,
    host: str,
    port: int,
    ready_file: Path | None,
    startup_delay: float = 0.0,
    drain_timeout: float = 30.0,
) -> None:
    """Run the simulator until SIGINT/SIGTERM; `startup_delay` stands in for loading weights."""
    # What an engine's log starts with, as vLLM's does: which model, and where.
    print(
        f"engine-sim: loading {settings.model} ({startup_delay:g}s), to serve on {host}", flush=True
    )
    if startup_delay > 0:
        await asyncio.sleep(startup_delay)
    if settings.fault == "exit-at-start":
        print(
            "RuntimeError: CUDA error: out of memory (simulated fault: exit-at-start)", flush=True
        )
        raise SystemExit(1)
    app = create_app(settings)
    sink: SpanSink | None = app.state.sink

    async def stopped() -> None:
        if sink is not None:
            await asyncio.to_thread(sink.close)

    listener = Listener("engine", app, host, port)
    await run_service(
        [listener], ready_file=ready_file, drain_timeout=drain_timeout, on_stop=stopped
    )
