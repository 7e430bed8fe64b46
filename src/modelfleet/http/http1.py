"""A lean HTTP/1.1 server for ASGI apps, for the listener every client request goes through.

The router's client listener runs on this instead of uvicorn because the benchmark says so
(`bench/router.py`): side by side with vllm-router, uvicorn's part of each request was what
kept the router's added latency above the Rust router's. What it does differently:

- The status line, the headers and the first body chunk leave in one write. uvicorn writes
  the headers as soon as the app sends them, so a client woke twice for one small answer.
- Idle kept-alive connections are closed by one sweep every few seconds, not by a timer
  set and cancelled around every request.
- Nothing the router does not use: no websockets, no lifespan, no proxy headers, no `date`
  or `server` header.

What it keeps from uvicorn: keep-alive and pipelined requests (answered in order), flow
control both ways (reading pauses while a body waits unread, the app waits while the client
reads slowly), `Expect: 100-continue`, `http.disconnect` when the client goes away (and
`ClientDisconnected`, an `OSError`, on a send after it), a 500 for an app that fails before
answering, and one ordered `shutdown()`: stop accepting, close idle connections, let the
requests in flight finish within a deadline, cancel what is left, close.

What it bounds, where uvicorn does not (`Bounds`): the time a request's head and body may
take to arrive, the head's size and number of lines as they arrive, the time an answer may
wait for a client that reads nothing, and the number of connections.

A server may also be given `take`, a handler that gets a POST whose whole (small) body is in
before any task is made for it. The router's proxy (`router/proxy.py`) carries most requests
this way, by callbacks; when one must wait it hands it to a task of its own
(`Cycle.carry_on`). A request it does not take goes to the ASGI app as any other, and so
does a pipelined request that waited for the one before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import urllib.parse
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httptools

from modelfleet.http.door import Door, DoorBounds, Visit

log = logging.getLogger("modelfleet.http")

# Unread request body above which the connection stops reading from its client.
HIGH_WATER = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024  # request line and headers, counted as they arrive; past this: 431
# Headers a request may carry once; a second is refused.
ONCE = frozenset({b"authorization", b"host", b"content-length", b"transfer-encoding"})
MAX_HEADERS = 100  # header lines in one request; past this: 431
# Requests read ahead of their turn on one connection (pipelined); past this the connection
# reads no more until they are answered, and an answer is not started while the client leaves
# the one before unread: 10,000 pipelined `GET /metrics` never read grew a router by 88 MiB.
MAX_PIPELINED = 16
# Seconds a connection that answered before its request's body was in keeps reading (and
# dropping) what the client still sends, after its answer and a half-close: closed at once,
# the client's unread data would reset the connection before it read the answer.
LINGER = 2.0
_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    301: "Moved Permanently", 302: "Found", 304: "Not Modified", 307: "Temporary Redirect",
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Content Too Large",
    422: "Unprocessable Content", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Gateway Timeout",
}  # fmt: skip
_STATUS_LINES: dict[int, bytes] = {}


class ClientDisconnected(OSError):
    """A send to a client that has gone away."""


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n".encode()
        _STATUS_LINES[status] = line
    return line


class _OnDisconnect:
    """The `modelfleet.on_disconnect` extension of a request's scope: its cycle's
    `call_on_disconnect`, holding the cycle weakly."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = weakref.ref(cycle)

    def __call__(self, callback: Callable[[], None] | None) -> None:
        cycle = self.cycle()
        if cycle is not None:
            cycle.call_on_disconnect(callback)


class Cycle:
    """One request and its answer on a connection."""

    __slots__ = (
        "__weakref__",
        "awaiting_take",
        "body",
        "body_given",
        "complete",
        "conn",
        "disconnected",
        "expect_continue",
        "framing",
        "head_request",
        "head_sent",
        "headers",
        "keep_alive",
        "more_body",
        "on_gone",
        "scope",
        "started",
        "status",
        "waiter",
    )

    def __init__(self, conn: _Connection, scope: dict[str, Any], keep_alive: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = False
        self.head_request = scope["method"] == "HEAD"
        self.body = b""  # read from the client, not yet given to the app
        self.more_body = True  # the client has more of the body to send
        self.body_given = False  # the whole body went to the app
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.started = False  # the app sent http.response.start
        self.head_sent = False  # the status line and headers are written
        self.complete = False  # the answer is sent in full
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # How the body's end is told: by its length, by chunks, or by closing the connection.
        self.framing: Literal["length", "chunked", "close"] = "length"
        self.on_gone: Callable[[], None] | None = None
        self.awaiting_take = False  # held for `take` until its whole body is in
        # Not the bound method: the scope would hold the cycle that holds the scope, a loop
        # only the garbage collector frees; the control plane collects fully once in ten
        # minutes and freezes what it holds after each pass, and 10,000 agents' requests
        # grew it by megabytes a second.
        scope["extensions"] = {"modelfleet.on_disconnect": _OnDisconnect(self)}

    def call_on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """The `modelfleet.on_disconnect` extension: `callback` is called at once when the
        client goes away before its answer is complete. The router's proxy uses it instead
        of a task waiting on `receive()` per request. A client already gone: called now."""
        self.on_gone = callback
        if callback is not None and self.disconnected and not self.complete:
            callback()

    def take_body(self) -> bytes:
        """The whole body, for `take`: the app is not given it again."""
        body, self.body = self.body, b""
        self.body_given = True
        return body

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        if self.expect_continue and not self.disconnected and not self.started:
            self.expect_continue = False
            self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.body_given:
            # After the whole body, the next message is the disconnect, whenever it comes;
            # an answer sent in full counts as one.
            await self._wait(lambda: self.disconnected or self.complete)
            return {"type": "http.disconnect"}
        await self._wait(
            lambda: self.disconnected or self.complete or bool(self.body) or not self.more_body
        )
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        body, self.body = self.body, b""
        self.body_given = not self.more_body
        self.conn.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def _wait(self, until: Callable[[], bool]) -> None:
        while not until():
            self.waiter = self.conn.loop.create_future()
            await self.waiter

    async def send(self, message: dict[str, Any]) -> None:
        if self.disconnected:
            raise ClientDisconnected("the client went away")
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return  # written with the first body chunk
        if kind != "http.response.body":
            raise RuntimeError(f"cannot send {kind!r} on an HTTP connection")
        if not self.started:
            raise RuntimeError("http.response.body before http.response.start")
        if self.complete:
            raise RuntimeError("http.response.body after the answer was complete")
        more = message.get("more_body", False)
        self._write(message.get("body", b""), more)
        if more and self.conn.write_paused:
            await self.conn.drained()

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, more: bool = False
    ) -> None:
        """Send an answer's head and `body` at once, for `take`, which answers without a
        task: the whole answer, or (`more`) its first bytes, the rest to follow by `send`
        from a task (`carry_on`). Nothing is sent to a client that has gone away."""
        if self.disconnected or self.started:
            return
        self.started = True
        self.status = status
        self.headers = headers
        self._write(body, more)

    def carry_on(self, work: Callable[[Any, Any], Awaitable[None]]) -> None:
        """Hand a taken request to a task: `work(receive, send)` finishes it as an ASGI app
        would. The server waits for it at shutdown like any request's task."""
        self.conn.start(self, work(self.receive, self.send))

    def _write(self, body: bytes, more: bool) -> None:
        out = b"" if self.head_sent else self._head(None if more else len(body))
        if self.head_request:
            pass
        elif self.framing == "chunked":
            if body:
                out += b"%x\r\n%b\r\n" % (len(body), body)
            if not more:
                out += b"0\r\n\r\n"
        else:
            out += body
        conn = self.conn
        if out:
            conn.transport.write(out)
        if not more:
            self.complete = True
            self.wake()
            conn.answered(self)

    def _head(self, length: int | None) -> bytes:
        """The status line and headers; `length`: the body's, when it is known whole."""
        parts = [_status_line(self.status)]
        has_length = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            elif lower == b"transfer-encoding":
                continue  # this server decides how the body is framed
            parts += [name, b": ", value, b"\r\n"]
        if not has_length and self.status >= 200 and self.status not in (204, 304):
            if length is not None:
                parts.append(b"content-length: %d\r\n" % length)
            elif self.scope["http_version"] == "1.0":  # no chunks in HTTP/1.0
                self.framing = "close"
                self.keep_alive = False
            else:
                self.framing = "chunked"
                parts.append(b"transfer-encoding: chunked\r\n")
        self.head_sent = True
        if length is not None and self.more_body and not self.body_given:
            # Answered whole before the body was read (a 413): the rest of it is never read,
            # so the connection cannot carry another request.
            self.keep_alive = False
        if not self.keep_alive or self.conn.server.stopping:
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def run(self, work: Awaitable[None]) -> None:
        try:
            await work
        except ClientDisconnected:
            pass
        except Exception:
            log.exception("the app failed on %s %s", self.scope["method"], self.scope["path"])
            self.fail()
            return
        if not self.complete and not self.disconnected:
            log.error("the app returned without a whole answer to %s", self.scope["path"])
            self.fail()

    def fail(self) -> None:
        """500 when nothing was sent yet; otherwise the connection is cut short."""
        if self.disconnected or self.complete:
            return
        if not self.head_sent:
            body = b'{"error":{"message":"Internal server error","type":"server_error"}}'
            self.keep_alive = False
            self.status = 500
            self.headers = [(b"content-type", b"application/json")]
            self.conn.transport.write(self._head(len(body)) + body)
            self.complete = True
            self.conn.answered(self)
        else:
            self.conn.transport.close()


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests and runs the app for each in turn."""

    def __init__(self, server: Http1Server, visit: Visit) -> None:
        self.server = server
        self.visit = visit
        self.loop = server.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.cycle: Cycle | None = None  # the request being answered
        self.parsing: Cycle | None = None  # the request being read (pipelined: a later one)
        self.queue: deque[Cycle] = deque()  # pipelined requests waiting for their turn
        self.task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None
        # When the request being read must be in: its head within `head_timeout` of its first
        # byte, its body within `body_timeout` of its head. None: no request being read.
        self.deadline: float | None = None
        self.reading_head = True  # between requests, or in a request's head
        self.discarding = False  # answered and half-closed: what comes in is dropped
        self.read_paused = False
        self.write_paused = False
        self.write_paused_at = 0.0
        self.held = False  # a pipelined request waits for the client to read what went before
        self.overfull = False  # it pipelined past `MAX_PIPELINED`: closed once they are answered
        self._drain: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._expect_continue = False
        self._length = b""  # the request's Content-Length, as sent
        self._encoding = b""  # its Transfer-Encoding, as sent
        self._refusal: tuple[int, str] | None = None  # why a callback stopped the parser
        self.server_addr: tuple[str, int] | None = None
        self.client_addr: tuple[str, int] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        own = transport.get_extra_info("sockname")
        self.client_addr = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.server_addr = tuple(own[:2]) if isinstance(own, tuple) else None
        self.server.connections.add(self)
        self.set_idle()

    @property
    def idle(self) -> bool:
        """Between requests, still sending a request's head, or answered and only dropping
        what its client still sends (`_linger`): closing it costs no answer."""
        return self.discarding or (self.cycle is None and not self.queue)

    def set_idle(self) -> None:
        self.visit.touch()
        self.idle_since = self.loop.time()
        self.server.idle[self] = None  # the newest idle connection, last

    def set_busy(self) -> None:
        self.idle_since = None
        self.server.idle.pop(self, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.visit.release()
        self.server.connections.discard(self)
        self.server.idle.pop(self, None)
        if self.cycle is not None:
            self.server.untake(self.cycle)
        self._gone()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _gone(self) -> None:
        """The client is gone, or cut off: every request of it learns so."""
        for cycle in (self.cycle, self.parsing, *self.queue):
            if cycle is not None and not cycle.disconnected:
                cycle.disconnected = True
                cycle.wake()
                if cycle.on_gone is not None and not cycle.complete:
                    cycle.on_gone()

    def data_received(self, data: bytes) -> None:
        if self.discarding or self.overfull:
            return
        if self.idle_since is not None:
            self.set_busy()
        try:
            while data:
                if not self.reading_head:
                    self.parser.feed_data(data)
                    return
                # A head is fed at most what is left of its limit at a time, so that one
                # endless header line is refused at the limit, not once httptools has
                # gathered all of it (a 64 MiB header once cost 120 MB and 5 s of CPU).
                if self.deadline is None:
                    self.deadline = self.loop.time() + self.server.head_timeout
                room = MAX_HEAD_BYTES - self._head_bytes
                if room <= 0:
                    self._refuse(431, "The request's headers are too large.")
                    return
                if len(data) <= room:  # the usual case: no copy
                    piece, data = data, b""
                else:
                    piece, data = data[:room], data[room:]
                self._head_bytes += len(piece)
                self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "Upgrades (websockets) are not served here.")
        except httptools.HttpParserError as exc:
            # httptools wraps what a callback raises in its own error.
            status, message = self._refusal or (400, f"Invalid HTTP request: {exc}")
            if status == 0:  # pipelined past the limit: answer what is queued, then close
                self.overfull = True
                self.pause_reading()
                return
            self._refuse(status, message)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_paused_at = self.loop.time()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.held:
            self.held = False
            if self.queue and self.cycle is None:
                self.start(self.queue.popleft())
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        """Wait until the client has read enough of what was written; a client that reads
        nothing for `write_timeout` seconds is cut off (ClientDisconnected)."""
        if self.write_paused and not self.transport.is_closing():
            self._drain = self.loop.create_future()
            try:
                async with asyncio.timeout(self.server.write_timeout):
                    await self._drain
            except TimeoutError:
                self.transport.abort()
                raise ClientDisconnected(
                    f"the client read nothing for {self.server.write_timeout:g} s"
                ) from None

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._length = b""
        self._encoding = b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self._headers) >= MAX_HEADERS:
            self._stop(431, f"The request has more than {MAX_HEADERS} header lines.")
        name = name.lower()
        if name in ONCE and any(seen == name for seen, _ in self._headers):
            # Which of two would count is a guess a proxy in front may make otherwise (it
            # checks one key, the service reads the other): refused, as RFC 9110 allows.
            self._stop(400, f"The request has more than one {name.decode().title()} header.")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        elif name == b"content-length":
            self._length = value
        elif name == b"transfer-encoding":
            self._encoding = value
        self._headers.append((name, value))

    def _stop(self, status: int, message: str) -> None:
        """Stop parsing from a callback: the request is refused with `status`."""
        self._refusal = (status, message)
        raise ValueError(message)

    def on_headers_complete(self) -> None:
        if self._encoding and self._encoding.strip().lower() != b"chunked":
            # Refused here, before the request is started: httptools refuses some forms only
            # after this callback, when an answer would already be under way.
            self._stop(400, "Transfer-Encoding other than 'chunked' is not accepted.")
        self.reading_head = False
        self.deadline = self.loop.time() + self.server.body_timeout if self._has_body() else None
        parser = self.parser
        version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        raw_path = url.path
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "method": parser.get_method().decode("ascii"),
            "scheme": self.server.scheme,
            "path": path,
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "root_path": "",
            "headers": self._headers,
            "server": self.server_addr,
            "client": self.client_addr,
            "state": {},
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        cycle = Cycle(self, scope, keep_alive)
        cycle.expect_continue = self._expect_continue
        self.parsing = cycle
        if self.cycle is None:
            if self._for_take(cycle):
                self.cycle = cycle
                cycle.awaiting_take = True
                return
            self.start(cycle)
        elif len(self.queue) >= MAX_PIPELINED:
            self.parsing = None
            self._stop(0, "pipelined past the limit")
        else:
            self.queue.append(cycle)  # answered after the one before it
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.complete:
            return  # an answered request's unread body is dropped
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def _has_body(self) -> bool:
        return bool(self._encoding) or (self._length not in (b"", b"0"))

    def on_message_complete(self) -> None:
        self.reading_head = True
        self.deadline = None
        self._head_bytes = 0
        cycle = self.parsing
        if cycle is None:
            return
        cycle.more_body = False
        if cycle.awaiting_take:
            cycle.awaiting_take = False
            self._take(cycle)
            return
        cycle.wake()

    # -- requests --------------------------------------------------------------------------

    def _for_take(self, cycle: Cycle) -> bool:
        """Whether `cycle` waits for its whole body and goes to `take`: a POST with a small
        body of known length, whose client does not wait for a 100 Continue."""
        length = self._length
        return (
            self.server.take is not None
            and cycle.scope["method"] == "POST"
            and not self._expect_continue
            and length.isdigit()
            and int(length) <= HIGH_WATER
        )

    def _take(self, cycle: Cycle) -> None:
        server = self.server
        assert server.take is not None
        server.taken.add(cycle)
        try:
            taken = server.take(cycle)
        except Exception:
            # Raised out of a parser callback it would read as a malformed request.
            log.exception("taking %s %s failed", cycle.scope["method"], cycle.scope["path"])
            cycle.fail()
            return
        if not taken:
            server.untake(cycle)
            self.start(cycle)
        elif cycle.complete:
            server.untake(cycle)

    def start(self, cycle: Cycle, work: Awaitable[None] | None = None) -> None:
        """Run `work` (by default the app) for `cycle` in a task of its own."""
        self.cycle = cycle
        self.server.untake(cycle)
        if work is None:
            work = self.server.app(cycle.scope, cycle.receive, cycle.send)
        self.task = self.loop.create_task(cycle.run(work))
        self.server.tasks.add(self.task)
        self.task.add_done_callback(self.server.task_done)

    def answered(self, cycle: Cycle) -> None:
        """`cycle`'s answer went out in full: close, or go on with the next request."""
        if cycle is not self.cycle:
            return
        self.server.untake(cycle)
        if not cycle.keep_alive:
            if cycle.more_body and not cycle.disconnected:
                self._linger()
            else:
                self.transport.close()
            return
        # A request answered before its body came whole (a 413): the rest is read and
        # dropped (`on_body`), and the next request starts after it.
        self.cycle = None
        if self.queue:
            if self.write_paused:
                # The client reads nothing of what was answered: the next answer waits for it
                # (`resume_writing`), cut off after `write_timeout` by the sweep.
                self.held = True
                return
            self.start(self.queue.popleft())
        elif self.overfull:
            self._linger()  # it pipelined past the limit: what it sent after is dropped
            return
        else:
            self.set_idle()
            if self.server.stopping:
                self.transport.close()
                return
        self.resume_reading()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self.queue:
            self.read_paused = False
            self.transport.resume_reading()

    def _linger(self) -> None:
        """Half-close after an answer sent before the request was read whole (a 413, a
        refusal): the client reads the answer while what it still sends is dropped, for
        `LINGER` seconds."""
        if self.discarding:
            return
        self.discarding = True
        self.deadline = None
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)

    def timed_out(self) -> None:
        """The request being read missed its deadline (`Http1Server.head_timeout`,
        `body_timeout`): 408 if nothing of an answer went out yet, and close."""
        what = "headers" if self.reading_head else "body"
        self._refuse(408, f"The request's {what} did not arrive in time.")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or came too slowly, and close."""
        body = message.encode()
        head = (
            _status_line(status) + b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        cycle = self.cycle
        if cycle is None or cycle.complete or not cycle.head_sent:
            self.transport.write(head + body)
        self._gone()  # an app still at work on a request here sees its client gone
        self._linger()


@dataclass(frozen=True)
class Bounds:
    """What a client may cost the server: seconds, connections, handshakes."""

    keep_alive: float = 30.0  # an idle connection is kept this long
    head_timeout: float = 10.0  # a request's head is in within this of its first byte
    body_timeout: float = 60.0  # its body within this of its head
    write_timeout: float = 60.0  # an answer the client reads nothing of is cut off after this
    max_connections: int = 10_000  # open at once, from accept (`door.Door`)
    max_handshakes: int = 256  # TLS handshakes under way at once
    handshake_timeout: float = 10.0  # seconds a TLS handshake may take

    @property
    def door(self) -> DoorBounds:
        return DoorBounds(self.max_connections, self.max_handshakes, self.handshake_timeout)


class Http1Server:
    """Serves an ASGI app over HTTP/1.1 on listening sockets, behind a `door.Door`.

    What bounds a client (`Bounds`): the door counts connections from accept, shares
    `max_connections` fairly between sources and bounds TLS handshakes; a request's head and
    body that come too slowly get 408 and the connection is closed (the same sweep finds them
    that closes idle connections); an answer the client reads nothing of for `write_timeout`
    is cut off; at most `MAX_PIPELINED` requests are read ahead of their turn.
    """

    def __init__(
        self,
        app: Any,
        take: Callable[[Cycle], bool] | None = None,
        bounds: Bounds = Bounds(),
        tls: ssl.SSLContext | None = None,
        name: str = "listener",
    ) -> None:
        self.app = app
        self.tls = tls  # the listener speaks TLS only (`pki.server_context`)
        self.scheme = "https" if tls is not None else "http"
        self.keep_alive = bounds.keep_alive
        self.head_timeout = bounds.head_timeout
        self.body_timeout = bounds.body_timeout
        self.write_timeout = bounds.write_timeout
        self.idle: dict[_Connection, None] = {}  # idle connections, the longest idle first
        # Gets each small POST once its body is in; True: it answers or carries it on.
        self.take = take
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.taken: set[Cycle] = set()  # taken requests being answered without a task
        self._quiet: asyncio.Future[None] | None = None  # set once nothing is in flight
        self.stopping = False
        self.loop = asyncio.get_running_loop()
        self.door = Door(lambda visit: _Connection(self, visit), bounds.door, tls, name)
        self._sweeper: asyncio.Task[None] | None = None

    def task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._check_quiet()

    def untake(self, cycle: Cycle) -> None:
        """`cycle` is answered, gone, or carried on by a task."""
        if cycle in self.taken:
            self.taken.discard(cycle)
            self._check_quiet()

    def _check_quiet(self) -> None:
        quiet = self._quiet
        if quiet is not None and not quiet.done() and not self.tasks and not self.taken:
            quiet.set_result(None)

    async def start(self, sock: socket.socket, backlog: int = 2048) -> None:
        """Accept connections on `sock`, which is bound and listening."""
        await self.door.start(sock, backlog)
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close connections idle for longer than `keep_alive`, and those whose request is
        late (`head_timeout`, `body_timeout`); a body the app is not reading yet is not late."""
        shortest = min(self.keep_alive, self.head_timeout, self.body_timeout)
        period = max(0.05, min(5.0, shortest / 4))
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            cutoff = now - self.keep_alive
            for conn in list(self.idle):
                if conn.idle_since is None or conn.idle_since >= cutoff:
                    break  # the rest have been idle for less time
                conn.transport.close()
                self.idle.pop(conn, None)
            stalled = now - self.write_timeout
            for conn in list(self.connections):
                deadline = conn.deadline
                if deadline is not None and deadline < now and not conn.read_paused:
                    conn.timed_out()
                elif conn.held and conn.write_paused_at < stalled:
                    conn.transport.abort()  # it pipelined and reads none of the answers

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop accepting, close idle connections, let requests in flight finish within
        `drain_timeout` seconds (each connection closes after its answer), cancel what is
        left, close every connection."""
        self.stopping = True
        self.door.close()
        for conn in list(self.connections):
            if conn.cycle is None:
                conn.transport.close()
        self._quiet = self.loop.create_future()
        self._check_quiet()
        await asyncio.wait([self._quiet], timeout=drain_timeout)
        if not self._quiet.done():
            late = set(self.tasks)
            log.warning("cutting %d request(s) still in flight", len(late) + len(self.taken))
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=5)
        for conn in list(self.connections):
            conn.transport.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.door.wait_closed()
