"""A flight's second stage: the replica tried next, the headers it is asked with, and why none
answered when none did."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from modelfleet.http.tracing import format_traceparent
from modelfleet.router.refusal import Refusal

if TYPE_CHECKING:
    from modelfleet.router.balancer import Balancer
    from modelfleet.router.exchange import Exchange, Plan

log = logging.getLogger("modelfleet.router")


def pick(plan: Plan, tried: list[str], balancer: Balancer) -> str | None:
    """The endpoint to try next (not one of `tried`), or None when none is left.

    A request released from a cold hold goes to the replica it was released to first: that
    replica holds the model (or adapter) now, even if it is the one that said 404 before the
    request was held."""
    if plan.first is not None:
        endpoint, plan.first = plan.first, None
        return endpoint
    return balancer.pick(plan.endpoints, exclude=tried, prefix=plan.prefix)


def engine_headers(plan: Plan, ex: Exchange, endpoint: str, span_id: str) -> list[tuple[str, str]]:
    """The headers a try of `endpoint` sends the request with: the engine's key, and the
    request's trace with the try's span (`span_id`) as the parent."""
    headers = [
        ("content-type", "application/json"),
        ("x-request-id", ex.request_id),
        ("traceparent", format_traceparent(ex.trace_id, span_id, ex.sampled)),
    ]
    engine_key = plan.table.keys.get(endpoint)
    if engine_key is not None:
        headers.append(("authorization", engine_key))
    return headers


def exhausted(ex: Exchange, tried: list[str], first_byte_timeout: float) -> Refusal:
    """Why no replica answered: none in rotation, all silent, or all failing."""
    if not tried:
        return Refusal(
            503,
            f"Every replica of `{ex.model}` is out of rotation after failing; try again shortly.",
            "server_error",
            "all-ejected",
            retry_after=1,
        )
    log.warning("no replica of %s answered: %s", ex.model, "; ".join(ex.failures))
    if ex.timeouts == len(tried):  # every replica tried was silent: a timeout, not a failure
        return Refusal(
            504,
            f"No replica of `{ex.model}` answered within {first_byte_timeout:g} s "
            f"({len(tried)} tried).",
            "server_error",
            "first-byte-timeout",
            code="upstream_timeout",
        )
    return Refusal(
        503,
        f"No replica of `{ex.model}` could answer ({len(tried)} tried).",
        "server_error",
        "upstream-failed",
        retry_after=1,
    )
