"""One trace per request: W3C trace context (`traceparent`) and the spans the router and the
simulator record.

The router takes a request's `traceparent` or makes one, and sends each attempt to its
engine with a child of its own span, so the tree reads: the caller's span (if any), the
router's span for the request, one span per attempt (retries included), and under each the
engine's own span. The ids cost a few random bits per request; spans are built and exported
only where an OTLP endpoint is set (`otlp.OtlpSink`, through OpenTelemetry's SDK, imported only
then), so a router without one pays nothing more.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

TRACEPARENT = b"traceparent"

AttributeValue = str | bool | int | float
SpanKind = Literal["server", "client", "internal"]


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A parsed `traceparent`: the trace, the span that is the parent, and whether the
    caller samples it."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    sampled: bool

    def header(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.sampled)


_HEX = frozenset("0123456789abcdef")


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The trace context of a `traceparent` header as W3C Trace Context level 1 reads it, or
    None for a missing or invalid one (then a new trace begins). A later version's header is
    read by its first four fields, as the standard asks."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if len(value) < 55 or (len(value) > 55 and value[55] != "-"):
        return None
    version, trace_id, span_id, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not _HEX.issuperset(version + trace_id + span_id + flags) or version == "ff":
        return None
    if version == "00" and len(value) != 55:
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16) & 1 == 1)


def format_traceparent(trace_id: str, span_id: str, sampled: bool) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def new_trace_id() -> str:
    return f"{random.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    return f"{random.getrandbits(64) or 1:016x}"


@dataclass(frozen=True)
class SpanRecord:
    """One finished span, in our own terms; times in nanoseconds since the epoch."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    kind: SpanKind
    attributes: Mapping[str, AttributeValue]
    error: str | None = None  # why it failed, for a span that did


class SpanSink(Protocol):
    """Where finished spans go."""

    def record(self, span: SpanRecord) -> None:
        """Take a finished span; never blocks on the network."""
        ...

    def close(self) -> None:
        """Send what is still held, then stop."""
        ...


def incomplete_traces(spans: list[SpanRecord]) -> dict[str, str]:
    """For each request the router recorded (a span of kind server with no parent among
    `spans`, or one whose parent is the caller's), why its tree is not whole, if it is not:
    it must hold as many attempt spans as the router made attempts, and under each attempt
    that the engine answered, that engine's span. Keyed by the router span's id."""
    children: dict[str, list[SpanRecord]] = {}
    for span in spans:
        if span.parent_id is not None:
            children.setdefault(span.parent_id, []).append(span)
    problems: dict[str, str] = {}
    for span in spans:
        if span.kind != "server" or "modelfleet.attempts" not in span.attributes:
            continue
        attempts = [c for c in children.get(span.span_id, []) if c.kind == "client"]
        made = span.attributes["modelfleet.attempts"]
        if len(attempts) != made:
            problems[span.span_id] = f"{len(attempts)} attempt spans of {made} attempts"
            continue
        for attempt in attempts:
            engines = [c for c in children.get(attempt.span_id, []) if c.kind == "server"]
            answered = "http.response.status_code" in attempt.attributes
            if answered and len(engines) != 1:
                problems[span.span_id] = f"attempt {attempt.span_id}: {len(engines)} engine spans"
                break
            if any(e.trace_id != span.trace_id for e in [attempt, *engines]):
                problems[span.span_id] = f"attempt {attempt.span_id}: another trace id"
                break
    return problems
