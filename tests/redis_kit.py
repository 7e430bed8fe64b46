"""A real Redis server for the tests of limits shared by routers: Debian's redis-server,
started on a free port of 127.0.0.1 in its own process group, nothing saved to disk, and
stopped by its pid when the test ends."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from modelfleet.processes import free_port, stop_groups


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(tmp: Path, timeout: float = 20) -> Iterator[str]:
    """A Redis server's URL (redis://127.0.0.1:PORT/0) while the block runs."""
    binary = shutil.which("redis-server")
    assert binary is not None, (
        "redis-server is not installed: `apt-get install redis-server` (.ci/run does it)"
    )
    port = free_port("127.0.0.1")
    log = (tmp / f"redis-{port}.log").open("ab")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while not _answers_ping(port):
            assert proc.poll() is None, (
                f"redis-server exited with {proc.returncode}; see {log.name}"
            )
            assert time.monotonic() < deadline, f"redis-server did not answer PING in {timeout} s"
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_groups([proc.pid], grace=5)
        proc.wait()
        log.close()
