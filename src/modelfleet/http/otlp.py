"""Spans out by OTLP, and back in: the OpenTelemetry SDK's side of `tracing.py`, imported only by
a process that has an OTLP endpoint set (the SDK costs a tenth of a second to import)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace import SpanKind as OtelKind
from opentelemetry.trace.status import Status, StatusCode

from modelfleet.http.tracing import AttributeValue, SpanKind, SpanRecord

_KINDS = {"server": OtelKind.SERVER, "client": OtelKind.CLIENT, "internal": OtelKind.INTERNAL}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class OtlpSink:
    """Spans exported by OTLP over HTTP (protobuf) to `endpoint`, the full traces URL (as
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` names it: `http://collector:4318/v1/traces`), in
    batches from a thread of the SDK's, so that a request never waits on the collector."""

    def __init__(self, endpoint: str, service: str, delay_s: float = 1.0) -> None:
        self._processor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=5),
            schedule_delay_millis=delay_s * 1000,
        )
        self._resource = Resource.create({"service.name": service})
        self._scope = InstrumentationScope("modelfleet")

    def record(self, span: SpanRecord) -> None:
        trace_id = int(span.trace_id, 16)
        parent = None
        if span.parent_id is not None:
            parent = SpanContext(trace_id, int(span.parent_id, 16), True, _SAMPLED)
        status = Status(StatusCode.ERROR, span.error) if span.error else Status(StatusCode.OK)
        readable = ReadableSpan(
            span.name,
            context=SpanContext(trace_id, int(span.span_id, 16), False, _SAMPLED),
            parent=parent,
            resource=self._resource,
            attributes=dict(span.attributes),
            kind=_KINDS[span.kind],
            status=status,
            start_time=span.start_ns,
            end_time=span.end_ns,
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(readable)

    def close(self) -> None:
        self._processor.shutdown()  # type: ignore[no-untyped-call]


def spans_of_export(body: bytes) -> list[SpanRecord]:
    """The spans in an OTLP/HTTP protobuf export request: what a collector receives. For
    checking a fleet's traces (tests, `bench/observe.py`) without running a collector."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    kinds: dict[int, SpanKind] = {2: "server", 3: "client"}
    out = []
    for resource_spans in request.resource_spans:
        service = next(
            (
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            ),
            "",
        )
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes: dict[str, AttributeValue] = {"service.name": service}
                for a in span.attributes:
                    kind = a.value.WhichOneof("value")
                    attributes[a.key] = getattr(a.value, kind) if kind else ""
                out.append(
                    SpanRecord(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex() or None,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        kind=kinds.get(span.kind, "internal"),
                        attributes=attributes,
                        error=span.status.message if span.status.code == 2 else None,
                    )
                )
    return out


class SpanCollector:
    """An OTLP/HTTP traces receiver of one's own on 127.0.0.1 (a free port), keeping what it
    is sent in memory: for checking a fleet's traces (tests, `bench/observe.py`) without
    running a collector. `start()` returns its traces URL."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                got = spans_of_export(body)
                with collector._lock:
                    collector.spans.extend(got)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"

    def taken(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
