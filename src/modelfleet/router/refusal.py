"""The router's own answer to a request it does not send on to an engine."""

from __future__ import annotations

from dataclasses import dataclass

from modelfleet.http.openai_api import error_body
from modelfleet.messages.wire import RoutedModel

# Statuses whose answer names why, in `x-modelfleet-reason`.
WHY_STATUSES = frozenset({429, 503, 504})


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

    def answer(self, request_id: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The head and body the client gets."""
        body = error_body(self.message, self.type, self.code, self.param)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode("latin-1")),
        ]
        if self.status in WHY_STATUSES:
            headers.append((b"x-modelfleet-reason", self.reason.encode()))
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return headers, body


def cannot_serve(route: RoutedModel) -> Refusal | None:
    """The 503 for a model none of whose replicas serves and none is on its way, with why as
    the control plane sees it (`RoutedModel.cannot_serve`), and no Retry-After: trying again
    shortly would get the same answer. None for anything else."""
    if not route.cannot_serve:
        return None
    return Refusal(
        503,
        f"`{route.name}` cannot serve now: {route.cannot_serve}",
        "server_error",
        "cannot-serve",
    )
