"""The router's client to engines: HTTP/1.1 POSTs over kept-alive connections, nothing more.

aiohttp's client took a quarter of the router's CPU per request in the profile (its request
and response objects, its connector, its stream reader). The data path needs far less: send a
body, read the status and headers, read the body as it arrives (httptools undoes the chunked
encoding), then give the connection back for the next request, or close it, which is how an
engine learns to abort. Each connection is one `asyncio.Protocol`; the parser's callbacks fill
the answer's buffer and wake its reader.

An idle connection is kept `idle_timeout` seconds, under uvicorn's default keep-alive of 5 s,
so the router rarely sends on a connection the engine is closing. When that happens anyway (a
reused connection ends before a byte of the answer came) the request goes once more on a new
connection: the engine never began it.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

# Where an endpoint is reached: host, port, and for https the name its certificate must carry.
Address = tuple[str, int, str | None]

# Past this many unread bytes the connection stops reading until the reader catches up.
_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The engine could not be reached, or its answer was cut off or could not be parsed.
    `unsent`: the request never reached the engine (no connection could be made)."""

    def __init__(self, message: str, unsent: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent


class Connection(asyncio.Protocol):
    """One connection to an engine and the one answer being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        # Told, instead of a waiting reader, when the answer's head and first bytes are in,
        # when it is whole, or when it failed (the router's `Attempt`).
        self.listener: Callable[[Connection], None] | None = None
        self.reset()

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self.status = 0
        self.header_list: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = self.loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.got_bytes = False
        self.complete = False
        self.keep_alive = False
        self.until_close = False  # an answer with neither length nor chunks ends at EOF
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"unreadable answer: {exc}"))
            self.close()
        self._tell()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if exc is None and self.until_close and self.headers_done.done():
            self.on_message_complete()
        else:
            why = "the engine closed the connection" + (f": {exc}" if exc else "")
            self._fail(UpstreamError(why))
        self._tell()

    def _tell(self) -> None:
        listener = self.listener
        if listener is not None and (self.error is not None or self.complete or self.chunks):
            listener(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        names = {name for name, _ in self.header_list}
        self.until_close = b"content-length" not in names and b"transfer-encoding" not in names
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive() and not self.until_close
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # read here: nobody may be waiting any more
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def take_chunks(self) -> bytes:
        """What has arrived of the body since last taken; reading resumes if it had paused."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


class Answer:
    """An engine's answer: status and headers at once, the body as it arrives."""

    def __init__(self, upstreams: Upstreams, key: Address, conn: Connection) -> None:
        self._upstreams = upstreams
        self._key = key
        self._conn = conn
        self.status = conn.status
        self.headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in conn.header_list
        }
        self._done = False

    @property
    def at_eof(self) -> bool:
        """Whether the whole answer has been read."""
        conn = self._conn
        return conn.complete and not conn.chunks

    async def read(self) -> bytes:
        """What has arrived of the body since the last read, waiting for some if none has;
        b"" once the answer is complete. Raises UpstreamError if it was cut off."""
        conn = self._conn
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            conn.waiter = conn.loop.create_future()
            try:
                await conn.waiter
            finally:
                conn.waiter = None
        return conn.take_chunks()

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it was read to its end
        and the engine keeps it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if self.at_eof and conn.keep_alive and conn.usable():
            self._upstreams._give_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        """Abandon the answer: the connection is closed, and the engine aborts the request."""
        self._done = True
        self._conn.close()


class Upstreams:
    """Kept-alive connections to every engine the router sends to, by host and port."""

    def __init__(
        self,
        connect_timeout: float,
        idle_timeout: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.clock = clock
        self._idle: dict[Address, list[tuple[Connection, float]]] = {}
        self._addresses: dict[str, Address] = {}
        self._tls: ssl.SSLContext | None = None
        self._names: Mapping[str, str] = {}

    def use_tls(self, context: ssl.SSLContext | None, names: Mapping[str, str]) -> None:
        """Reach https endpoints with `context` (the fleet's CA, a router's certificate),
        checking that each answers with a certificate for the name `names` gives it (its
        node's, `pki.node_host`). Connections already made stay, and so does what an endpoint
        no longer named resolves to: a request in flight to it still reads its answer."""
        self._tls, self._names = context, names
        for endpoint, name in names.items():
            known = self._addresses.get(endpoint)
            if known is not None and known[2] != name:
                del self._addresses[endpoint]

    @property
    def tls(self) -> ssl.SSLContext | None:
        """The client context https endpoints are reached with (`use_tls`)."""
        return self._tls

    def _address(self, endpoint: str) -> Address:
        address = self._addresses.get(endpoint)
        if address is None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or parts.hostname is None:
                raise UpstreamError(
                    f"cannot send to {endpoint!r}: only http:// or https://host:port",
                    unsent=True,
                )
            name = None
            if parts.scheme == "https":
                name = self._names.get(endpoint)
                if self._tls is None or name is None:
                    raise UpstreamError(
                        f"cannot reach {endpoint}: no client certificate or node name for it "
                        "from the control plane yet",
                        unsent=True,
                    )
            address = (parts.hostname, parts.port or (443 if name else 80), name)
            self._addresses[endpoint] = address
        return address

    async def post(
        self, endpoint: str, path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Answer:
        """POST `body` to `endpoint` + `path`; returns once the answer's headers are in. For
        callers that wait (benchmarks, tests): the router's requests go by `idle`/`connect`,
        `send` and the connection's callback (`flight.py`)."""
        conn = self.idle(endpoint)
        if conn is not None:
            try:
                return await self._exchange(endpoint, conn, path, body, headers)
            except UpstreamError:
                if conn.got_bytes:
                    raise
                # The engine closed a kept-alive connection as the request went out; it never
                # began the request, so a new connection carries it.
        conn = await self.connect(endpoint)
        return await self._exchange(endpoint, conn, path, body, headers)

    async def _exchange(
        self,
        endpoint: str,
        conn: Connection,
        path: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
    ) -> Answer:
        self.send(endpoint, conn, path, body, headers)
        try:
            await conn.headers_done
        except BaseException:
            conn.close()
            raise
        return self.answer(endpoint, conn)

    def idle(self, endpoint: str) -> Connection | None:
        """A kept-alive connection to `endpoint` to send a request on at once, if one is
        idle. Raises UpstreamError (unsent) for an endpoint that is no http://host:port."""
        return self._take_idle(self._address(endpoint))

    async def connect(self, endpoint: str) -> Connection:
        """A new connection to `endpoint`, within `connect_timeout`. Raises UpstreamError
        (unsent)."""
        return await self._connect(self._address(endpoint))

    def send(
        self,
        endpoint: str,
        conn: Connection,
        path: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
    ) -> None:
        """POST `body` on `conn`, from `idle` or `connect`; the answer fills `conn`."""
        _write(conn, _head(self._address(endpoint), path, len(body), headers), body)

    def answer(self, endpoint: str, conn: Connection) -> Answer:
        """The answer on `conn` (from `send`), once its head is in."""
        return Answer(self, self._address(endpoint), conn)

    async def _connect(self, key: Address) -> Connection:
        loop = asyncio.get_running_loop()
        host, port, name = key
        context = None if name is None else self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop), host, port, ssl=context, server_hostname=name
                )
        except TimeoutError as exc:
            raise UpstreamError(
                f"no connection to {key[0]}:{key[1]} within {self.connect_timeout:g} s",
                unsent=True,
            ) from exc
        except (OSError, ssl.SSLError) as exc:  # ssl.CertificateError is an OSError too
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc}", unsent=True) from exc
        return conn

    def _take_idle(self, key: Address) -> Connection | None:
        idle = self._idle.get(key)
        now = self.clock()
        while idle:
            conn, since = idle.pop()
            if now - since < self.idle_timeout and conn.usable():
                conn.reset()
                return conn
            conn.close()
        return None

    def _give_back(self, key: Address, conn: Connection) -> None:
        now = self.clock()
        idle = self._idle.setdefault(key, [])
        # The oldest idle connections sit at the front; those past their time are closed.
        while idle and now - idle[0][1] >= self.idle_timeout:
            idle.pop(0)[0].close()
        idle.append((conn, now))

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for conn, _ in idle:
                conn.close()
        self._idle.clear()


def _head(address: Address, path: str, length: int, headers: Sequence[tuple[str, str]]) -> bytes:
    """A POST's request line and headers."""
    head = [f"POST {path} HTTP/1.1\r\nhost: {address[0]}:{address[1]}\r\n"]
    head += [f"{name}: {value}\r\n" for name, value in headers]
    head.append(f"content-length: {length}\r\n\r\n")
    return "".join(head).encode("latin-1")


def _write(conn: Connection, head: bytes, body: bytes) -> None:
    transport = conn.transport
    assert transport is not None
    if len(body) < 65536:
        transport.write(head + body)
    else:
        transport.write(head)
        transport.write(body)
