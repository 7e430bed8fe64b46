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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from modelfleet.openai_api import BadRequest, error_response, parse_body, prompt_text
from modelfleet.serving import Listener, run_service
from modelfleet.simulator.engine import SimEngine, SimSettings
from modelfleet.web import bearer_matches, json_response


class _VllmMetrics:
    """A Prometheus collector reading the engine's counters at scrape time, in vLLM's names."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e, labels = self.engine, [self.engine.settings.model]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests decoding now.", e.running),
            ("vllm:num_requests_waiting", "Requests waiting for a slot.", e.waiting),
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
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter


class _HangAfter:
    """From `at` (monotonic) on, every request waits forever: the engine hangs, still running."""

    def __init__(self, app: ASGIApp, at: float) -> None:
        self.app = app
        self.at = at

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and time.monotonic() >= self.at:
            await asyncio.Event().wait()
        await self.app(scope, receive, send)


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
        return json_response({"object": "list", "data": [card]})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def chat(request: Request) -> Response:
        return await _complete(request, engine, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, engine, chat=False)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    if settings.api_key is not None:
        app.add_middleware(_KeyRequired, key=settings.api_key)
    if settings.hang_after is not None:
        app.add_middleware(_HangAfter, at=time.monotonic() + settings.hang_after)
    app.state.engine = engine
    return app


async def _complete(request: Request, engine: SimEngine, chat: bool) -> Response:
    try:
        body = parse_body(await request.body())
        prompt = prompt_text(body, chat)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise BadRequest("'max_tokens' must be a non-negative integer", param="max_tokens")
        if body.get("n", 1) != 1:
            # Refused rather than answered with one choice: a client asking for several
            # would take the one it got for all it asked for.
            raise BadRequest("this engine makes one choice per request: 'n' must be 1", param="n")
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", param=exc.param)
    if body["model"] != engine.settings.model:
        return error_response(
            404,
            f"The model `{body['model']}` does not exist; this engine serves "
            f"`{engine.settings.model}`.",
            "invalid_request_error",
            code="model_not_found",
            param="model",
        )
    n_prompt = max(1, len(prompt.split()))
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "created": int(time.time()),
        "model": engine.settings.model,
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
    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield event([first])
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
            yield event([choice])
    finally:
        await tokens.aclose()  # type: ignore[attr-defined]  # a stream cut short frees its slot
    finish = _finish_reason(n_out, max_tokens)
    last: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        last["delta"] = {}
    else:
        last.update(text="", logprobs=None)
    yield event([last])
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
    if startup_delay > 0:
        await asyncio.sleep(startup_delay)
    if settings.fault == "exit-at-start":
        print(f"loading {settings.model} ...", flush=True)
        print(
            "RuntimeError: CUDA error: out of memory (simulated fault: exit-at-start)", flush=True
        )
        raise SystemExit(1)
    listener = Listener("engine", create_app(settings), host, port)
    await run_service([listener], ready_file=ready_file, drain_timeout=drain_timeout)
