"""The router's own answer to a request it does not send on to an engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """The router's own answer to a request it does not send on: an OpenAI-style error, and
    why (the `refusals` metric, `x-modelfleet-reason`)."""

    status: int
    message: str
    type: str
    reason: str
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None
