"""A flight's last stage: the key's reservation settled, the request counted in the metrics
and its key's usage, and the router's span of it recorded."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from modelfleet.http.tracing import AttributeValue, SpanRecord

if TYPE_CHECKING:
    from modelfleet.http.tracing import SpanSink
    from modelfleet.router.exchange import Exchange, Parts
    from modelfleet.router.limits import Ticket

log = logging.getLogger("modelfleet.router")


def tokens_used(ex: Exchange) -> int | None:
    """The tokens a request used, as its reservation is settled to: what the engine reported;
    else None (the reservation stands) if an engine may have worked on it (the client hung
    up, the answer broke off, or it named no usage), and 0 if none did (no engine took it, or
    each that did refused it with an error)."""
    used = ex.scanner.usage if ex.scanner is not None else None
    if used is not None:
        return used.total
    return None if ex.maybe_used else 0


def settle(parts: Parts, ex: Exchange, ticket: Ticket) -> None:
    """Settle the key's reservation to `tokens_used`, in the background: the answer does not
    wait for the store."""
    tokens = tokens_used(ex)
    if parts.limits.settle_at_once(ticket, tokens, parts.wall()):
        return
    settling = asyncio.ensure_future(parts.limits.settle(ticket, tokens, parts.wall()))
    parts.background.add(settling)
    settling.add_done_callback(parts.background.discard)


def count(parts: Parts, ex: Exchange, attempts: int) -> None:
    """Count the request in the metrics and in its key's usage, and record its span."""
    metrics = parts.metrics
    usage = ex.scanner.usage if ex.scanner is not None else None
    if ex.client_gone:
        metrics.child(metrics.cancellations, ex.model).inc()
        log.debug("the client of %s went away; cancelled upstream", ex.request_id)
    else:
        end = parts.clock()
        first_byte = ex.first_byte_at - ex.started if ex.first_byte_at is not None else None
        own = max(0.0, end - ex.started - ex.upstream_wait)
        gap = None
        streamed = ex.scanner is not None and ex.scanner.stream
        if streamed and usage is not None and usage.completion > 1 and first_byte is not None:
            gap = (end - ex.started - first_byte) / (usage.completion - 1)
        if ex.refusal is None:
            metrics.request_done(ex.model, ex.status, end - ex.started, first_byte, own, gap)
        else:
            metrics.refused(ex.model, ex.status, ex.refusal)
    if usage is not None:
        metrics.used(ex.model, usage.prompt, usage.completion)
    if ex.key is not None:
        parts.ledger.count(ex.key, ex.model, parts.wall(), usage, ex.status)
    if parts.spans is not None and ex.sampled:
        record(parts.spans, parts, ex, attempts)


def record(spans: SpanSink, parts: Parts, ex: Exchange, attempts: int) -> None:
    """The router's span of the request: model, status, attempts, its own overhead and the
    time to the first byte."""
    end = parts.clock()
    attributes: dict[str, AttributeValue] = {
        "gen_ai.request.model": ex.model,
        "http.response.status_code": ex.status,
        "modelfleet.request_id": ex.request_id,
        "modelfleet.attempts": attempts,
        "modelfleet.router_overhead_ms": max(0.0, end - ex.started - ex.upstream_wait) * 1e3,
    }
    if ex.key is not None:
        attributes["modelfleet.key"] = ex.key
    if ex.first_byte_at is not None:
        attributes["modelfleet.first_byte_ms"] = (ex.first_byte_at - ex.started) * 1e3
    error = None
    if ex.client_gone:
        error = "the client went away"
    elif ex.status >= 500:
        error = "; ".join(ex.failures) or f"HTTP {ex.status}"
    spans.record(
        SpanRecord(
            name=f"router {ex.path}",
            trace_id=ex.trace_id,
            span_id=ex.span_id,
            parent_id=ex.caller_span,
            start_ns=parts.epoch_ns(ex.started),
            end_ns=parts.epoch_ns(end),
            kind="server",
            attributes=attributes,
            error=error,
        )
    )
