"""A flight's third stage: the engine's answer relayed to the client.

The head the client gets (`answer_head`), each chunk as the client gets it with its usage
read on the way (`scanned`), and the rest of an answer that did not come whole, relayed
chunk by chunk as it arrives (`Relay`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from modelfleet.http.openai_api import error_body
from modelfleet.router.exchange import Broken, ClientGone
from modelfleet.router.refusal import WHY_STATUSES
from modelfleet.router.upstream import UpstreamError

if TYPE_CHECKING:
    from modelfleet.router.exchange import Plan
    from modelfleet.router.upstream import Answer
    from modelfleet.router.usage import UsageScanner

log = logging.getLogger("modelfleet.router")


def answer_head(
    upstream: Answer, plan: Plan, endpoint: str, request_id: str, scanner: UsageScanner | None
) -> list[tuple[bytes, bytes]]:
    """The headers the client gets with an engine's answer. Its length goes with it unless
    the scanner changes the body (`hide`)."""
    headers = [
        (b"content-type", upstream.headers.get("content-type", "application/json").encode()),
        (b"x-request-id", request_id.encode("latin-1")),
        (b"x-modelfleet-replica", plan.table.replicas.get(endpoint, endpoint).encode()),
    ]
    length = upstream.headers.get("content-length")
    if length is not None and not (scanner is not None and scanner.hide):
        headers.append((b"content-length", length.encode()))
    if plan.stream:
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    if upstream.status in WHY_STATUSES:
        headers.append((b"x-modelfleet-reason", b"engine"))
        if "retry-after" in upstream.headers:
            headers.append((b"retry-after", upstream.headers["retry-after"].encode()))
    return headers


def scanned(scanner: UsageScanner | None, chunk: bytes, last: bool) -> bytes:
    """`chunk` as the client gets it, its usage read on the way."""
    if scanner is None:
        return chunk
    out = scanner.feed(chunk)
    return out + scanner.finish() if last else out


class Relay:
    """The rest of one answer, relayed to the client's ASGI `send` chunk by chunk.

    A gap between chunks longer than `gap` seconds ends a stream with an OpenAI-style error
    event; a whole answer cut short is cut for the client too (its Content-Length says so:
    `Broken`). `waited`: the seconds spent waiting for the engine."""

    def __init__(
        self,
        send: Callable[[Any], Awaitable[None]],
        clock: Callable[[], float],
        gap: float,
        scanner: UsageScanner | None,
        stream: bool,
        model: str,
        endpoint: str,
    ) -> None:
        self.send = send
        self.clock = clock
        self.gap = gap
        self.scanner = scanner
        self.stream = stream
        self.model = model
        self.endpoint = endpoint
        self.waited = 0.0

    async def run(
        self, upstream: Answer, headers: list[tuple[bytes, bytes]] | None, first: bytes
    ) -> bool:
        """Relay `upstream` after its head and `first` bytes (sent first when `headers` is
        given; else they went out already). True when the answer was read whole. Raises
        ClientGone when the client went away, Broken when a whole answer broke off."""
        send, clock = self.send, self.clock
        try:
            if headers is not None:
                start = {"type": "http.response.start", "status": upstream.status}
                await send({**start, "headers": headers})
                if first:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
            ended = upstream.at_eof
            if ended:  # the rest came before this task ran
                out = scanned(self.scanner, b"", last=True)
                await send({"type": "http.response.body", "body": out, "more_body": False})
            while not ended:
                waited = clock()
                try:
                    async with asyncio.timeout(self.gap):
                        chunk = await upstream.read()
                except (TimeoutError, UpstreamError) as exc:
                    self.waited += clock() - waited
                    await self._broke_off(exc)
                    break
                self.waited += clock() - waited
                # The last chunk, when it is known to be the last, ends the answer: its end
                # costs no send of its own.
                ended = upstream.at_eof
                out = scanned(self.scanner, chunk, last=ended)
                if out or ended:
                    await send({"type": "http.response.body", "body": out, "more_body": not ended})
        except OSError as exc:  # the client went away mid-answer
            raise ClientGone() from exc
        return upstream.at_eof

    async def _broke_off(self, exc: Exception) -> None:
        """The engine's answer stopped after its first byte: a stream ends with an error
        event; a whole answer, which carries its length, is cut short (`Broken`)."""
        why = f"no data for {self.gap:g} s" if isinstance(exc, TimeoutError) else type(exc).__name__
        log.warning("answer of %s from %s broke off: %s", self.model, self.endpoint, why)
        if not self.stream:
            raise Broken(why) from exc
        event = error_body(
            f"The engine stopped answering mid-stream ({why}).",
            "server_error",
            code="upstream_stalled",
        )
        body = b"data: " + event + b"\n\ndata: [DONE]\n\n"
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
