"""An engine's gate (`modelfleet engine-gate`): real processes on 127.0.0.1, the gate in front
of the engine simulator, reached with a router's certificate, a node's, a server's of the same
CA, another CA's, and none."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from modelfleet.host.processes import free_port, stop_groups
from modelfleet.router.upstream import UpstreamError, Upstreams
from modelfleet.security.pki import (
    CertificateAuthority,
    TlsFiles,
    client_context,
    client_context_with,
    node_host,
    read_request,
    request,
)

from .conftest import wait_for

NOW = datetime.datetime.now(datetime.UTC)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}], "max_tokens": 3}
# Every path real vLLM 0.32 serves besides its /v1 API: none may answer a client that is not
# a router (vLLM checks its key on /v1 paths only).
VLLM_PATHS = ["/invocations", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize",
              "/classify", "/health", "/metrics", "/version", "/ping",
              "/v1/chat/completions"]  # fmt: skip


class Gated:
    """A gate and its engine, and the certificates a client may try it with."""

    def __init__(self, tmp: Path, max_connections: int = 4096) -> None:
        self.ca = CertificateAuthority.create("fleet", NOW)
        (tmp / "ca.crt").write_bytes(self.ca.cert_pem)
        key_pem, csr = request(["x"])
        node_cert = self.ca.sign_node(read_request(csr), "gpu-1", ["127.0.0.1"], NOW)
        self.node = TlsFiles(tmp / "node.crt", tmp / "node.key")
        self.node.cert.write_bytes(node_cert)
        self.node.key.write_bytes(key_pem)
        self.port, self.engine_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.log = (tmp / "gate.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "engine-gate", "--listen",
             f"127.0.0.1:{self.port}", "--engine-port", str(self.engine_port), "--cert",
             str(self.node.cert), "--key", str(self.node.key), "--ca", str(tmp / "ca.crt"),
             "--max-connections", str(max_connections), "--",
             sys.executable, "-m", "modelfleet", "engine-sim", "--model", "m", "--port",
             str(self.engine_port), "--itl", "0.001"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.url = f"https://127.0.0.1:{self.port}"

    def router(self) -> ssl.SSLContext:
        return client_context_with(self.ca.cert_pem, self.ca.issue_router_client(NOW))

    def post(self, context: ssl.SSLContext, path: str = "/v1/chat/completions") -> int:
        with httpx.Client(verify=context, timeout=10) as client:
            return client.post(self.url + path, json=CHAT).status_code

    def refusing(self, context: ssl.SSLContext) -> bool:
        try:
            self.post(context)
        except (httpx.TransportError, ssl.SSLError):
            return True
        return False

    def stop(self) -> int:
        stop_groups([self.proc.pid], grace=20)
        return self.proc.wait(timeout=30)


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[Gated]:
    made = Gated(tmp_path)
    yield made
    if made.proc.poll() is None:
        made.stop()


def test_a_router_certificate_passes_the_gate_and_nothing_else_does(
    gated: Gated, tmp_path: Path
) -> None:
    router = gated.router()
    wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
    with httpx.Client(verify=router, timeout=10) as client:
        streamed = client.post(gated.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")

    # A node's certificate is of the same CA but names no router; a server certificate of the
    # CA is for no client; a client certificate of the CA names no router; another fleet's
    # router certificate is of another CA; none at all.
    # The handshake fails or the gate hangs up before a byte of the engine's is read, on
    # every path the engine serves.
    other = CertificateAuthority.create("another fleet", NOW)
    node = client_context(gated.ca.cert_pem)
    node.load_cert_chain(gated.node.cert, gated.node.key)
    server = client_context_with(gated.ca.cert_pem, gated.ca.issue(["router"], NOW))
    strangers = {
        "node": node,
        "server": server,
        "client": client_context_with(gated.ca.cert_pem, gated.ca.issue(["x"], NOW, client=True)),
        "other CA": client_context_with(gated.ca.cert_pem, other.issue_router_client(NOW)),
        "none": client_context(gated.ca.cert_pem),
    }
    for who, context in strangers.items():
        for path in VLLM_PATHS:
            with pytest.raises((httpx.TransportError, ssl.SSLError)):
                gated.post(context, path)
                raise AssertionError(f"{who} got an answer on {path}")
    assert gated.post(router) == 200  # and the router still does
    assert "refused" in (tmp_path / "gate.log").read_text()


def test_the_gate_exits_as_its_engine_does(gated: Gated) -> None:
    router = gated.router()
    wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
    assert gated.stop() == 0  # SIGTERM to the group: the engine drains, the gate follows


def test_a_router_reaches_a_gate_only_under_the_node_name_it_was_given(gated: Gated) -> None:
    router = gated.router()
    wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
    body = json.dumps(CHAT).encode()

    async def status(names: dict[str, str], context: ssl.SSLContext | None) -> int | str:
        upstreams = Upstreams(connect_timeout=5)
        upstreams.use_tls(context, names)
        try:
            answer = await upstreams.post(gated.url, "/v1/chat/completions", body, [])
            answer.close()
            return answer.status
        except UpstreamError as exc:
            return str(exc)
        finally:
            upstreams.close()

    assert asyncio.run(status({gated.url: node_host("gpu-1")}, router)) == 200
    # gpu-1's certificate does not pass for gpu-2 (it is reached at the address the table
    # gives gpu-2), nor is anything sent without a node name or a client certificate.
    wrong = asyncio.run(status({gated.url: node_host("gpu-2")}, router))
    assert "certificate" in str(wrong), wrong
    assert "no client certificate or node name" in str(asyncio.run(status({}, router)))
    unnamed = asyncio.run(status({gated.url: node_host("gpu-1")}, None))
    assert "no client certificate or node name" in str(unnamed)


def test_an_engine_does_not_outlive_its_gate_killed(gated: Gated) -> None:
    router = gated.router()
    wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
    [engine] = psutil.Process(gated.proc.pid).children()
    os.kill(gated.proc.pid, signal.SIGKILL)  # the gate alone, not its group
    gated.proc.wait(timeout=10)
    wait_for("the engine to stop (told by PR_SET_PDEATHSIG)", lambda: not engine.is_running()
             or engine.status() == psutil.STATUS_ZOMBIE, 30, 0.1)  # fmt: skip


def test_handshakes_never_finished_cannot_take_the_gate(tmp_path: Path) -> None:
    """A gate counts connections from their accept, and a handshake never finished is what
    gives way to a newcomer: four left half-open (no TLS handshake) from another address fill
    a gate of four, and a router is served all the same; a router's own connections, closed,
    give their places back."""
    gated = Gated(tmp_path, max_connections=4)
    try:
        router = gated.router()
        wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
        for _ in range(5):  # more than the cap, one after another
            assert gated.post(router) == 200
        idle = [
            socket.create_connection(("127.0.0.1", gated.port), source_address=("127.0.0.2", 0))
            for _ in range(4)
        ]
        try:
            for _ in range(5):
                assert gated.post(router) == 200
        finally:
            for sock in idle:
                sock.close()
        assert gated.post(router) == 200
    finally:
        gated.stop()


def test_connection_churn_never_locks_routers_out_of_the_gate(tmp_path: Path) -> None:
    """Issue 56: the gate remembered released connections by `id()`, which CPython reuses,
    so its count of open connections only grew: the real gate refused every router after 208
    requests at a cap of 32, and about 4,100 failed handshakes did it at the default cap. Here
    a gate of 8 takes 400 failed handshakes and 100 routers' requests, one after another,
    and serves a router after them."""
    gated = Gated(tmp_path, max_connections=8)
    try:
        router = gated.router()
        wait_for("the engine behind its gate", lambda: gated.post(router) == 200, 30, 0.1)
        for i in range(400):
            with socket.create_connection(("127.0.0.1", gated.port), timeout=10) as sock:
                if i % 2:
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a TLS handshake
                    sock.recv(100)
        statuses = [gated.post(router) for _ in range(100)]
        assert statuses == [200] * 100
    finally:
        gated.stop()
