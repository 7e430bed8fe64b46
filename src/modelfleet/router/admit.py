"""A flight's first stage: admission under its key's limits.

The limits answer from memory or a lease at once where they can (`Limits.admit_at_once`),
else after asking the store (`Limits.admit`); either way their answer becomes the key's
reservation (a `Ticket`) or the router's own refusal, here."""

from __future__ import annotations

from modelfleet.router.limits import Refusal as LimitRefusal
from modelfleet.router.limits import Ticket
from modelfleet.router.refusal import Refusal


def admission(got: Ticket | LimitRefusal, key: str, cost: int) -> Ticket | Refusal:
    """The limits' answer for key `key` reserving `cost` tokens: its ticket, or the refusal
    the client gets (429 naming the limit, or 503 naming why the limits store cannot count
    it)."""
    if not isinstance(got, LimitRefusal):
        return got
    if got.limit == "store":
        why = f" ({got.why})" if got.why else ""
        return Refusal(
            503,
            f"The router cannot count key '{key}' against its limits: its limits store does "
            f"not answer{why}. Requests of keys with limits are refused until it does; try "
            "again shortly.",
            "server_error",
            "limits-store-unreachable",
            retry_after=1,
        )
    return Refusal(
        429,
        got.message(key, cost),
        "tokens" if got.limit == "tpm" else "requests",
        f"key-{got.limit}",
        code="rate_limit_exceeded",
        retry_after=got.retry_after_s,
    )
