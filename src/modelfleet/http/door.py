"""The door of every listener: accepts connections, counts them from the moment they are
accepted, shares the listener's cap fairly between sources, and makes TLS with a deadline.

Every port the fleet opens goes through a `Door`: the HTTP listeners (`http1.Http1Server`:
router, control plane, agent, simulator) and the engine gate (`agent/gate.py`), which relays
bytes instead of speaking HTTP. What it bounds, for all of them alike (`DoorBounds`):

- **Connections**, counted from accept, TLS handshakes under way included (5,000 connections
  that never began a handshake once held 5,021 file descriptors of a control plane whose cap,
  counted only after handshakes, was 382).
- **Fairly between sources** (a source is the peer's IP address): past the cap, room is made
  by closing a connection that does nothing for anyone (idle between requests, still sending
  its head, or still in its handshake) of the source holding the most connections; a newcomer
  is turned away only when its own source holds at least as many as any other and none of them
  can be closed. So one source that floods the listener loses its own connections to others'
  newcomers instead of locking them out.
- **TLS handshakes**: each must finish within `handshake_timeout`, and at most
  `max_handshakes` are under way at once, shared between sources the same way.

Each accepted connection is a `Visit`, tracked by the object itself (released once, by a flag
on it): the gate once tracked released connections by `id()`, which CPython reuses, so its
count of open connections only grew and it refused every router after a few thousand failed
handshakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

log = logging.getLogger("modelfleet.http")


@dataclass(frozen=True)
class DoorBounds:
    """What the door of a listener admits."""

    max_connections: int = 10_000  # open at once, handshakes under way included
    max_handshakes: int = 256  # TLS handshakes under way at once
    handshake_timeout: float = 10.0  # seconds a TLS handshake may take


class Guest(Protocol):
    """What a door asks of the protocol that serves a connection once it is in: the loop
    calls its `connection_made` (after the TLS handshake, when there is one), and its
    `connection_lost` calls `visit.release()`."""

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """Its connection's transport, once made."""
        ...

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    @property
    def idle(self) -> bool:
        """Whether closing the connection now costs nobody an answer: it waits between
        requests or is still sending a request's head."""
        ...


class Visit:
    """One accepted connection, from accept until it is closed."""

    __slots__ = ("door", "guest", "handshake", "released", "sock", "source")

    def __init__(self, door: Door, source: str, sock: socket.socket) -> None:
        self.door = door
        self.source = source
        self.sock: socket.socket | None = sock  # until a transport owns it
        self.guest: Guest | None = None
        self.handshake: asyncio.Task[None] | None = None  # its TLS handshake, under way
        self.released = False

    @property
    def closable(self) -> bool:
        """Closing it now costs nobody an answer."""
        return self.handshake is not None or self.guest is None or self.guest.idle

    def touch(self) -> None:
        """It went idle: the last of its source to be closed for room, as the most recent."""
        if not self.released:
            self.door.open.touch(self)

    def release(self) -> None:
        """The connection is closed: it counts no more (called once or more; counted once)."""
        if not self.released:
            self.released = True
            self.door.left(self)

    def close(self) -> None:
        self.release()
        if self.handshake is not None:
            self.handshake.cancel()  # the loop closes the transport it was making
        elif self.guest is not None and self.guest.transport is not None:
            self.guest.transport.close()
        elif self.sock is not None:
            self.sock.close()


class _Pool:
    """Visits counted by source, oldest first within each."""

    def __init__(self) -> None:
        self.by_source: dict[str, dict[Visit, None]] = {}
        self.count = 0

    def add(self, visit: Visit) -> None:
        self.by_source.setdefault(visit.source, {})[visit] = None
        self.count += 1

    def touch(self, visit: Visit) -> None:
        visits = self.by_source.get(visit.source)
        if visits is not None and visit in visits:
            del visits[visit]
            visits[visit] = None

    def discard(self, visit: Visit) -> None:
        visits = self.by_source.get(visit.source)
        if visits is not None and visit in visits:
            del visits[visit]
            self.count -= 1
            if not visits:
                del self.by_source[visit.source]

    def room_for(self, newcomer: Visit, cap: int) -> Visit | None:
        """A visit to close so that `newcomer` (counted already) may stay, of a pool capped at
        `cap`: a closable one of the source holding the most; of its own source only when
        that source holds the most. When none can be closed, the oldest of a source that
        holds more than `newcomer`'s and more than its share of the cap (the cap over the
        sources present) is closed all the same: 450 requests from one source whose bodies
        never came once turned away half an honest operator's requests. None: the newcomer
        is the one to turn away."""
        own = len(self.by_source.get(newcomer.source, ()))
        heavier = []
        for source, visits in sorted(self.by_source.items(), key=lambda kv: -len(kv[1])):
            if len(visits) < own:
                break
            if source == newcomer.source:
                continue
            victim = _first_closable(visits, newcomer)
            if victim is not None:
                return victim
            heavier.append(visits)
        victim = _first_closable(self.by_source.get(newcomer.source, {}), newcomer)
        if victim is not None:
            return victim
        share = cap // max(1, len(self.by_source))
        for visits in heavier:
            if len(visits) > own and len(visits) > share:
                return next(iter(visits))
        return None


def _first_closable(visits: dict[Visit, None], newcomer: Visit) -> Visit | None:
    for visit in visits:
        if visit is not newcomer and visit.closable:
            return visit
    return None


class Door:
    """Accepts the connections of one listener (see the module's docstring). `guest(visit)`
    makes the protocol that serves a connection once it is in (after its TLS handshake, when
    `tls` is set); that protocol calls `visit.release()` when its connection is lost.

    It accepts from the listening socket itself and gives each connection to the loop with
    `connect_accepted_socket`: the source is known before any byte is read, and a handshake
    that fails or is cut is an exception here, on asyncio's loop and uvloop's alike (uvloop's
    `start_tls` on an accepted connection lost the ClientHello that came before it)."""

    def __init__(
        self,
        guest: Callable[[Visit], Guest],
        bounds: DoorBounds = DoorBounds(),
        tls: ssl.SSLContext | None = None,
        name: str = "listener",
    ) -> None:
        self.guest = guest
        self.bounds = bounds
        self.tls = tls
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.open = _Pool()
        self.handshakes = _Pool()
        self.turned_away = 0  # newcomers closed at once: no room made for them
        self.closed_for_room = 0  # connections closed to make room for a newcomer
        self.handshakes_failed = 0
        self._socks: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, sock: socket.socket, backlog: int = 2048) -> None:
        """Accept connections on `sock`, which is bound and listening; `backlog` again, for
        a socket that listened with less."""
        sock.listen(backlog)
        sock.setblocking(False)
        self._socks.append(sock)
        self.loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        """Stop accepting; connections already in stay."""
        for sock in self._socks:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(sock.fileno())
            sock.close()
        self._socks.clear()

    async def wait_closed(self) -> None:
        """Cut the handshakes still under way."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1)

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(128):  # then other work gets its turn
            try:
                conn, peer = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of file descriptors: accept again in a second, as asyncio does.
                    log.error("%s: cannot accept: %s; trying again in 1 s", self.name, exc)
                    self.loop.remove_reader(listening.fileno())
                    self.loop.call_later(1.0, self._resume, listening)
                return
            conn.setblocking(False)
            source = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
            self.arrived(Visit(self, source, conn))

    def _resume(self, listening: socket.socket) -> None:
        if listening in self._socks:
            self.loop.add_reader(listening.fileno(), self._accept, listening)

    def arrived(self, visit: Visit) -> None:
        self.open.add(visit)
        if self.open.count > self.bounds.max_connections and not self._make_room(visit, self.open):
            return
        if self.tls is not None:
            self.handshakes.add(visit)
            if self.handshakes.count > self.bounds.max_handshakes and not self._make_room(
                visit, self.handshakes
            ):
                return
        task = self.loop.create_task(self._let_in(visit))
        if self.tls is not None:
            visit.handshake = task
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._after(visit, done))

    def _after(self, visit: Visit, task: asyncio.Task[None]) -> None:
        """A connection's way in ended. One cancelled before its task ran never reached the
        loop, and its socket is closed here: missed, it stayed open for good (the control
        plane freezes what its collector would have freed)."""
        self._tasks.discard(task)
        if visit.sock is not None:  # no transport took it
            visit.handshake = None
            visit.release()
            with contextlib.suppress(OSError):
                visit.sock.close()
            visit.sock = None

    def _make_room(self, newcomer: Visit, pool: _Pool) -> bool:
        """Close one connection so that `newcomer` may stay; False: it was turned away."""
        cap = self.bounds.max_connections if pool is self.open else self.bounds.max_handshakes
        victim = pool.room_for(newcomer, cap)
        if victim is None:
            self.turned_away += 1
            if self.turned_away == 1 or self.turned_away % 1000 == 0:
                log.warning(
                    "%s: %d connection(s) open, %d handshake(s) under way, none to close for "
                    "%s: turned away %d new connection(s)",
                    self.name, self.open.count, self.handshakes.count, newcomer.source,
                    self.turned_away,
                )  # fmt: skip
            newcomer.close()
            return False
        self.closed_for_room += 1
        victim.close()
        return True

    def left(self, visit: Visit) -> None:
        self.open.discard(visit)
        self.handshakes.discard(visit)

    async def _let_in(self, visit: Visit) -> None:
        sock = visit.sock
        assert sock is not None
        try:
            await self.loop.connect_accepted_socket(
                lambda: cast(asyncio.BaseProtocol, self._guest_of(visit)),
                sock,
                ssl=self.tls,
                ssl_handshake_timeout=self.bounds.handshake_timeout if self.tls else None,
            )
        except (OSError, TimeoutError, asyncio.CancelledError):
            # ssl.SSLError is an OSError; a cancelled one was closed to make room. Its socket
            # is closed once the task is done (`_after`).
            self.handshakes_failed += 1
            return
        visit.sock = None  # its transport owns it
        visit.handshake = None
        self.handshakes.discard(visit)
        if visit.released and visit.guest is not None and visit.guest.transport is not None:
            visit.guest.transport.close()

    def _guest_of(self, visit: Visit) -> Guest:
        guest = self.guest(visit)
        visit.guest = guest
        return guest
