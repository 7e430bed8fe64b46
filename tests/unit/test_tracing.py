"""One trace per request: the trace context read and written as W3C says, the router's span
and one span per attempt (retries included), each engine sent its attempt's span as parent,
and spans out by OTLP read back as they went."""

from __future__ import annotations

import asyncio
import dataclasses

from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelfleet.http.tracing import (
    SpanRecord,
    format_traceparent,
    incomplete_traces,
    parse_traceparent,
)
from modelfleet.messages.wire import RoutedModel

from .router_kit import client_of, keyed, run, serving, until

hex_ids = st.integers(min_value=1, max_value=2**128 - 1).map(lambda n: f"{n:032x}")
span_ids = st.integers(min_value=1, max_value=2**64 - 1).map(lambda n: f"{n:016x}")


@given(hex_ids, span_ids, st.booleans())
def test_a_traceparent_reads_back_as_it_was_written(trace: str, span: str, sampled: bool) -> None:
    parsed = parse_traceparent(format_traceparent(trace, span, sampled))
    assert parsed is not None
    assert (parsed.trace_id, parsed.span_id, parsed.sampled) == (trace, span, sampled)


def test_invalid_traceparents_begin_a_new_trace() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) is not None
    assert parse_traceparent(good.encode()) == parse_traceparent(good)
    for bad in (
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 has no more
    ):
        assert parse_traceparent(bad) is None, bad
    # A later version is read by its first four fields.
    later = parse_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-what")
    assert later is not None and not later.sampled


class Recorder:
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []

    def record(self, span: SpanRecord) -> None:
        self.spans.append(span)

    def close(self) -> None:
        pass


CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_router_records_its_span_and_one_per_attempt_and_sends_each_engine_its_own() -> None:
    """The first answer of all is a 503: the request that meets it is retried on the other
    engine, and its trace shows both attempts under the router's span, each engine sent the
    span of its own attempt as the parent."""
    seen: list[str] = []

    async def complete(request: Request) -> Response:
        seen.append(request.headers["traceparent"])
        if len(seen) == 1:
            return JSONResponse({"error": "busy"}, status_code=503)
        return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})

    engine = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])
    recorder = Recorder()

    async def go() -> None:
        async with serving(engine) as one, serving(engine) as two:
            router = keyed(models=[RoutedModel(name="m", endpoints=[one, two])], retries=1)
            router.parts = dataclasses.replace(router.parts, spans=recorder)
            async with client_of(router) as client:
                body = {"model": "m", "prompt": "x"}
                r = await client.post("/v1/completions", json=body, headers={"traceparent": CALLER})
                assert r.status_code == 200
                await until("the router's span", lambda: len(recorder.spans) == 3)
                retried = list(recorder.spans)
                assert len(seen) == 2
                # Unsampled by its caller: passed on as unsampled, and nothing recorded.
                unsampled = CALLER[:-2] + "00"
                r = await client.post(
                    "/v1/completions", json=body, headers={"traceparent": unsampled}
                )
                assert r.status_code == 200 and seen[-1].endswith("-00")
                assert seen[-1].split("-")[1] == CALLER.split("-")[1]
                # No traceparent: a trace of its own, its router span a root.
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200
                await until("the new trace's spans", lambda: len(recorder.spans) == 5)
            await router.close()

        attempts = [s for s in retried if s.kind == "client"]
        (request,) = [s for s in retried if s.kind == "server"]
        trace = CALLER.split("-")[1]
        assert request.trace_id == trace and request.parent_id == CALLER.split("-")[2]
        assert request.attributes["gen_ai.request.model"] == "m"
        assert request.attributes["http.response.status_code"] == 200
        assert request.attributes["modelfleet.attempts"] == 2
        assert request.error is None
        assert [a.attributes["modelfleet.attempt"] for a in attempts] == [1, 2]
        assert [a.error for a in attempts] == ["HTTP 503", None]
        assert [a.attributes["http.response.status_code"] for a in attempts] == [503, 200]
        for attempt, header in zip(attempts, seen[:2], strict=True):
            assert attempt.trace_id == trace and attempt.parent_id == request.span_id
            assert header == f"00-{trace}-{attempt.span_id}-01"
            assert request.start_ns <= attempt.start_ns <= attempt.end_ns <= request.end_ns
        # The engines here record no spans: the trace is not whole, and says where.
        assert incomplete_traces(retried) == {
            request.span_id: f"attempt {attempts[0].span_id}: 0 engine spans"
        }
        engine_spans = [
            dataclasses.replace(request, span_id=f"{n:016x}", parent_id=a.span_id, attributes={})
            for n, a in enumerate(attempts, 1)
        ]
        assert incomplete_traces([*retried, *engine_spans]) == {}
        assert "1 attempt spans of 2" in incomplete_traces([request, attempts[1]])[request.span_id]
        new = [s for s in recorder.spans[3:] if s.kind == "server"]
        assert len(new) == 1 and new[0].parent_id is None and new[0].trace_id != trace
        assert seen[-1] == f"00-{new[0].trace_id}-{recorder.spans[3].span_id}-01"

    run(go())


def test_spans_sent_by_otlp_read_back_as_they_went() -> None:
    from modelfleet.http.otlp import OtlpSink, spans_of_export

    received: list[SpanRecord] = []

    async def traces(request: Request) -> Response:
        received.extend(spans_of_export(await request.body()))
        return Response(status_code=200)

    collector = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    span = SpanRecord(
        name="router /v1/completions",
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        span_id="00f067aa0ba902b7",
        parent_id="a3ce929d0e0e4736",
        start_ns=1_700_000_000_000_000_000,
        end_ns=1_700_000_000_250_000_000,
        kind="server",
        attributes={"gen_ai.request.model": "m", "http.response.status_code": 503},
        error="every replica failed",
    )

    async def go() -> None:
        async with serving(collector) as url:
            sink = OtlpSink(f"{url}/v1/traces", "modelfleet-test", delay_s=0.05)
            sink.record(span)
            await asyncio.to_thread(sink.close)
            await until("the export", lambda: len(received) == 1)

    run(go())
    (got,) = received
    assert got.attributes["service.name"] == "modelfleet-test"
    assert dataclasses.replace(got, attributes=span.attributes) == span
    assert {k: v for k, v in got.attributes.items() if k != "service.name"} == span.attributes
