"""The hostile-client kit: what a stranger who can reach a port does to it, each attack
bounded in count and time, each followed by an honest client who must still be served.

`Door` is one listener as its ready file describes it (URL, bounds, the pid serving it), so
that every listener a fleet registers is attacked without a test written for it. Attacks
come from 127.0.0.2 (the stranger) and honest clients from 127.0.0.3, so that a listener's
sharing between sources is what is tested. Used by tests/integration/test_doors.py and
bench/doors.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

STRANGER = "127.0.0.2"
HONEST = "127.0.0.3"


@dataclass
class Door:
    """One listener of the fleet under attack."""

    name: str
    url: str
    pid: int
    bounds: dict[str, Any] = field(default_factory=dict)
    tls: ssl.SSLContext | None = None  # how an honest client reaches it, for an https URL
    sni: str | None = None  # the name it is reached by over TLS (an engine's gate: its node's)

    @property
    def address(self) -> tuple[str, int]:
        where = urlsplit(self.url)
        return where.hostname or "127.0.0.1", where.port or 80

    @property
    def https(self) -> bool:
        return self.url.startswith("https:")

    def raw(self, source: str = STRANGER, timeout: float = 30) -> socket.socket:
        """A plain TCP connection from `source`."""
        return socket.create_connection(self.address, timeout=timeout, source_address=(source, 0))

    def connect(self, source: str = STRANGER, timeout: float = 30) -> socket.socket:
        """A connection that speaks the listener's protocol (TLS for https) from `source`."""
        sock = self.raw(source, timeout)
        if self.https:
            context = self.tls or _unverified()
            return context.wrap_socket(sock, server_hostname=self.sni or self.address[0])
        return sock

    def served(self, source: str = HONEST) -> str:
        """The status line an honest client gets for `GET /health` (any answer is service:
        401 and 404 too); '' when it got none."""
        try:
            with self.connect(source, timeout=15) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                return _read_all(sock, 15).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError:
            return ""

    def rss_mb(self) -> float:
        return float(psutil.Process(self.pid).memory_info().rss) / 2**20


def _unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def slow_head(door: Door) -> str:
    """Half a head, and no more: the first line of what the listener answers, or how it ended."""
    with door.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer = _read_all(sock, door.bounds.get("head_timeout", 10.0) + 20)
    return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed without an answer"


def huge_head(door: Door) -> str:
    with door.connect() as sock:
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 70_000)
        answer = _read_all(sock, 20)
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def deep_body(door: Door, depth: int = 100_000) -> str:
    """A JSON body nested `depth` deep, POSTed to the listener's root: any answer but a
    crash (the honest client after it tells)."""
    body = b"[" * depth + b"]" * depth
    with door.connect() as sock:
        with contextlib.suppress(OSError):
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
            )
        answer = _read_all(sock, 20)
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def bad_utf8(door: Door) -> str:
    body = b'{"model": "\xff\xfe", "messages": [{"role": "user", "content": "\xc3\x28"}]}'
    with door.connect() as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        answer = _read_all(sock, 20)
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def churn(door: Door, cycles: int = 500) -> None:
    """Open and close, `cycles` times; on TLS, half of them cut mid-handshake."""
    for i in range(cycles):
        with contextlib.suppress(OSError), door.raw() as sock:
            if door.https and i % 2:
                sock.sendall(b"\x16\x03\x01\x00\x05hello")  # a handshake that goes nowhere


@contextlib.contextmanager
def absent_handshakes(door: Door, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections that never begin their TLS handshake (or their request)."""
    socks = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):
                socks.append(door.raw())
        yield socks
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def flood(door: Door, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections from the stranger, idle or sending a head that never ends."""
    socks = []
    try:
        for i in range(count):
            try:
                sock = door.connect(timeout=5)
            except OSError:
                continue  # turned away: the cap holds
            if i % 2:
                with contextlib.suppress(OSError):
                    sock.sendall(b"GET / HTTP/1.1\r\nX-Slow: ")
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def pipeline_unread(door: Door, requests: int = 20_000, seconds: float = 5.0) -> float:
    """Pipeline `requests` GETs and read none of the answers for `seconds`: how far the
    serving process's memory grew meanwhile, in MB."""
    before = door.rss_mb()
    grown = 0.0
    payload = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 1000
    with door.connect() as sock:
        sock.setblocking(False)
        sent = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sent < requests:
                with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError, OSError):
                    sock.send(payload)
                    sent += 1000
            grown = max(grown, door.rss_mb() - before)
            time.sleep(0.01)
    return grown


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closed `sock` (end of stream or a reset) within `within` seconds
    of now."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True  # reset: closed


def registered(run_dir: Path, engines: list[str]) -> list[Door]:
    """Every listener a fleet registered: each service's ready file in `run_dir` (URL, bounds
    and pid of each listener it opens, `http/serving.py`), and each engine's endpoint."""
    found = []
    for ready in sorted(run_dir.glob("*.json")):
        described = json.loads(ready.read_text())
        for name, url in described.get("urls", {}).items():
            bounds = described.get("bounds", {}).get(name, {})
            found.append(Door(f"{ready.stem} {name}", url, described["pid"], bounds))
    found += [Door(f"engine {url}", url, 0) for url in engines]
    return found


def at_once(doors: list[Door], attack: Callable[[Door], Any]) -> dict[str, Any]:
    """`attack` on every door at once (a thread each): what each gave, or how it failed."""
    results: dict[str, Any] = {}

    def run(door: Door) -> None:
        try:
            results[door.name] = attack(door)
        except Exception as exc:  # the result names the door that failed and how
            results[door.name] = f"failed: {exc!r}"

    threads = [threading.Thread(target=run, args=(door,)) for door in doors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results
