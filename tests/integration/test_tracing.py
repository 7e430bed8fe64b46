"""One trace per request across real processes: the router and two engine simulators send
their spans by OTLP to a collector; every request's spans form one tree under the caller's
span, a retried request's included."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelfleet.http.otlp import SpanCollector
from modelfleet.http.tracing import SpanRecord, incomplete_traces

from .conftest import Procs, wait_for
from .test_processes import KEY, start_engine, start_router

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def collector() -> Iterator[SpanCollector]:
    got = SpanCollector()
    yield got
    got.stop()


def closed_port() -> str:
    """An address on 127.0.0.1 where nothing listens: a replica whose engine is gone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_every_request_through_router_and_engine_is_one_trace(
    procs: Procs, tmp_path: Path, collector: SpanCollector
) -> None:
    traces = collector.start()
    one, _ = start_engine(procs, tmp_path, "m", "--otlp-endpoint", traces)
    dead = closed_port()
    # No reads of the engines' load (watch_interval 0): two unanswered reads of the dead one
    # would eject it, on a slow machine before any request met it, and nothing would retry.
    router = start_router(
        procs,
        tmp_path,
        [{"name": "m", "endpoints": [one, dead]}],
        otlp_endpoint=traces,
        watch_interval=0,
    )
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=KEY, timeout=20, max_retries=0)
    sent = 0
    for i in range(40):  # each picks the dead replica first half the time, until it is ejected
        client.completions.create(
            model="m",
            prompt=f"x {i}",
            max_tokens=2,
            extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"} if i == 0 else {},
        )
        sent += 1
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 3
        sent += 1
        if i >= 4 and any(s.attributes.get("modelfleet.attempts") == 2 for s in collector.taken()):
            break

    def requests_spans() -> list[SpanRecord] | None:
        spans = [s for s in collector.taken() if "modelfleet.attempts" in s.attributes]
        return spans if len(spans) >= sent else None

    wait_for(f"the router's spans of {sent} requests", requests_spans)
    wait_for("every trace whole", lambda: not incomplete_traces(collector.taken()), timeout=10)
    spans = collector.taken()
    requests = [s for s in spans if "modelfleet.attempts" in s.attributes]
    assert len(requests) == sent
    assert len({s.trace_id for s in requests}) == sent  # one trace each
    retried = [s for s in requests if s.attributes["modelfleet.attempts"] == 2]
    assert retried, "no request met the dead replica first"
    first = next(s for s in requests if s.trace_id == CALLER_TRACE)
    assert first.parent_id == CALLER_SPAN
    engines = [s for s in spans if s.attributes.get("service.name") == "modelfleet-engine-sim"]
    assert len(engines) == sent  # one engine span per request: the dead replica made none
    streamed = [e for e in engines if e.name == "engine /v1/chat/completions"]
    assert len(streamed) == sent // 2 and all(e.end_ns > e.start_ns for e in streamed)
    assert incomplete_traces(spans) == {}
