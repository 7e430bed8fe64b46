"""A real Redis server for the tests of limits shared by routers: Debian's redis-server,
started on a free port of 127.0.0.1 in its own process group, nothing saved to disk, and
stopped by its pid when the test ends. A test may stop and start it again on its port (a
restart loses every count), or pause it (SIGSTOP: a server that hangs, silent, not down)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from modelfleet.host.processes import free_port, stop_groups


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server on a port of its own."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, (
            "redis-server is not installed: `apt-get install redis-server` (.ci/run does it)"
        )
        self.binary = binary
        self.tmp = tmp
        self.port = free_port("127.0.0.1")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> None:
        with (self.tmp / f"redis-{self.port}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.tmp)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not _answers_ping(self.port):
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"redis-server did not answer PING in {timeout} s"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            stop_groups([self.proc.pid], grace=5)
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """The server hangs: it keeps its connections and answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def running_redis(tmp: Path) -> Iterator[RedisServer]:
    """A Redis server, started, while the block runs."""
    server = RedisServer(tmp)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A Redis server's URL (redis://127.0.0.1:PORT/0) while the block runs."""
    with running_redis(tmp) as server:
        yield server.url
