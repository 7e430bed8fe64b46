"""An engine's gate: the TLS listener in front of an engine that other machines reach.

Engines differ in the TLS they offer: vLLM can require client certificates, SGLang and
llama.cpp serve TLS but let any client in, a `command` engine may offer none, and real vLLM
checks its key on `/v1` paths only (`/invocations` answered a chat completion with no key).
So an agent whose engines are reached across machines starts each engine that serves HTTP on
loopback, behind a gate of its own (`modelfleet engine-gate`): the gate listens on the node's
address with the node's certificate, lets in only clients that present a router's certificate
of the fleet's CA (`pki.is_router`), and relays their bytes to the engine and back. Every path
of the engine is behind it alike; the agent itself reaches its engine on loopback.

The gate starts the engine as its child, in its own process group, so the agent supervises
one process as before: told to stop (SIGTERM, which the agent sends to the gate alone), the
gate takes no new connection, passes the signal on to the engine, relays what is in flight until
the engine exits, and exits as the engine did. The engine is told to stop if the gate dies
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from modelfleet.host.processes import die_with_parent
from modelfleet.http.door import Door, DoorBounds, Visit
from modelfleet.security.pki import PkiError, TlsFiles, gate_context, is_router

log = logging.getLogger("modelfleet.gate")

_HANDSHAKE_TIMEOUT = 10.0  # seconds a client has to finish its TLS handshake
_ENGINE_CONNECT_TIMEOUT = 10.0


@dataclass(frozen=True)
class GateSettings:
    """Where the gate listens, the engine's loopback port, the node's certificate, the CA
    whose router certificates are let in, and the engine's command line."""

    host: str
    port: int
    engine_port: int
    tls: TlsFiles
    ca: Path
    argv: list[str]
    max_connections: int = 4096  # accepted at once, TLS handshakes under way included


class _Side(asyncio.Protocol):
    """One end of a relayed connection: what it receives goes to the other end. Either end
    closing closes both; a full write buffer on one end pauses reading on the other."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _Side | None = None
        self.pending: list[bytes] = []  # received before the other end was connected
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def joined(self, other: _Side) -> None:
        """`other` is connected: what waited for it goes now."""
        self.other = other
        if other.transport is not None:
            for data in self.pending:
                other.transport.write(data)
        self.pending.clear()
        if self.closed:
            other.close()

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is None or other.transport is None:
            self.pending.append(data)
        else:
            other.transport.write(data)

    def eof_received(self) -> bool | None:
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.other is not None:
            self.other.close()

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class _Client(_Side):
    """A client's connection, let in by the door after its TLS handshake: a router's is
    relayed to the engine, any other is closed."""

    def __init__(self, gate: Gate, visit: Visit) -> None:
        super().__init__()
        self.gate = gate
        self.visit = visit
        self.connecting: asyncio.Future[None] | None = None

    @property
    def idle(self) -> bool:
        return False  # relayed bytes may be a request under way: never closed for room

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not is_router(transport.get_extra_info("peercert")):
            peer = transport.get_extra_info("peername")
            self.gate.refused(peer)
            self.close()
            return
        self.gate.clients.add(self)
        self.connecting = asyncio.ensure_future(self.gate.connect_engine(self))

    def connection_lost(self, exc: Exception | None) -> None:
        # Also called for a handshake that failed (asyncio's start_tls), before any
        # connection_made: the visit counts once whichever way it ends.
        super().connection_lost(exc)
        self.gate.clients.discard(self)
        self.visit.release()


class Gate:
    """The gate of one engine: its door (`http.door`: connections counted from accept, shared
    fairly between sources, TLS with a deadline) and the connections it relays."""

    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self.clients: set[_Client] = set()
        self.refusals = 0
        self.door: Door | None = None

    def refused(self, peer: object, why: str = "no router certificate of the fleet") -> None:
        # One line for the first refusal and then one in a thousand: a scan must not fill
        # the engine's log.
        self.refusals += 1
        if self.refusals == 1 or self.refusals % 1000 == 0:
            log.warning("engine gate: refused %s: %s (%d refused)", peer, why, self.refusals)

    async def connect_engine(self, client: _Client) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(_ENGINE_CONNECT_TIMEOUT):
                _, engine = await loop.create_connection(
                    _Side, "127.0.0.1", self.settings.engine_port
                )
        except (OSError, TimeoutError):
            client.close()  # the engine is not listening yet, or no more
            return
        engine.joined(client)
        client.joined(engine)

    async def run(self) -> int:
        """Start the engine, serve until it exits; its exit status (128 + N for a signal)."""
        s = self.settings
        bounds = DoorBounds(
            max_connections=s.max_connections,
            max_handshakes=min(256, s.max_connections),
            handshake_timeout=_HANDSHAKE_TIMEOUT,
        )
        loop = asyncio.get_running_loop()
        door = self.door = Door(
            lambda visit: _Client(self, visit), bounds, gate_context(s.tls, s.ca), "engine gate"
        )
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.port))
        sock.listen(2048)
        sock.setblocking(False)
        await door.start(sock)
        gate_pid = os.getpid()
        engine = await asyncio.create_subprocess_exec(
            *s.argv, preexec_fn=lambda: die_with_parent(gate_pid)
        )

        def stop(sig: signal.Signals) -> None:
            door.close()
            if engine.returncode is None:
                engine.send_signal(sig)  # the agent signals the gate alone

        loop.add_signal_handler(signal.SIGTERM, stop, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, stop, signal.SIGINT)
        code = await engine.wait()
        door.close()
        for client in list(self.clients):
            client.close()
        return 128 - code if code < 0 else code


def run_gate(settings: GateSettings) -> int:
    """Run the gate and its engine; the engine's exit status. On asyncio's own loop: uvloop's
    `start_tls` on an accepted connection lost handshakes (one in three timed out here)."""
    try:
        return asyncio.run(Gate(settings).run())
    except (OSError, PkiError) as exc:
        log.error("engine gate: cannot serve on %s:%d: %s", settings.host, settings.port, exc)
        return 1
