"""What an engine's gate costs a request: the same engine reached directly on loopback (plain
HTTP, as a router on the engine's own host would) and through its gate (TLS with a router's
certificate, relayed to the engine on loopback), side by side in one run, with the router's
own upstream client (`router/upstream.py`) and kept-alive connections, as the router sends.

    python bench/engine_gate.py [--requests 2000] [--concurrency 16]

The engine is the simulator with no time to first token and one output token, so what is
measured is the hop. It ends with one JSON line: p50_ms and p99_ms of one request at a time
and req_per_s with `--concurrency` at once, for `direct` and `gated`, and `gate_added_p50_ms`
and `gate_throughput_ratio` (gated / direct).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kit import answers, end_on_sigterm, json_line, wait

from modelfleet.host.processes import free_port, stop_groups
from modelfleet.router.upstream import Upstreams
from modelfleet.security.pki import CertificateAuthority, client_context_with, read_request, request

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}
).encode()
HEADERS = [("content-type", "application/json")]
NODE = "gpu-1"


def wait_ready(url: str, verify: Any, deadline_s: float = 30) -> None:
    wait(f"{url}/health to answer", lambda: answers(url + "/health", verify), deadline_s, 0.1)


async def one(upstreams: Upstreams, endpoint: str) -> float:
    began = time.perf_counter()
    answer = await upstreams.post(endpoint, "/v1/chat/completions", BODY, HEADERS)
    while await answer.read():
        pass
    answer.release()
    if answer.status != 200:
        raise RuntimeError(f"{endpoint} answered {answer.status}")
    return time.perf_counter() - began


async def measure(upstreams: Upstreams, endpoint: str, count: int, at_once: int) -> dict[str, Any]:
    for _ in range(50):  # connections made, caches warm
        await one(upstreams, endpoint)
    times = sorted([await one(upstreams, endpoint) for _ in range(count)])

    async def worker(n: int) -> None:
        for _ in range(n):
            await one(upstreams, endpoint)

    began = time.perf_counter()
    await asyncio.gather(*(worker(count // at_once) for _ in range(at_once)))
    took = time.perf_counter() - began
    return {
        "p50_ms": round(times[len(times) // 2] * 1000, 3),
        "p99_ms": round(times[int(len(times) * 0.99)] * 1000, 3),
        "req_per_s": round((count // at_once) * at_once / took, 1),
    }


def main() -> int:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    now = datetime.datetime.now(datetime.UTC)
    ca = CertificateAuthority.create("bench", now)
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-gate-bench-"))
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    key_pem, csr = request(["x"])
    (folder / "node.crt").write_bytes(ca.sign_node(read_request(csr), NODE, ["127.0.0.1"], now))
    (folder / "node.key").write_bytes(key_pem)
    direct_port, gate_port, inner_port = (free_port("127.0.0.1") for _ in range(3))
    sim = [sys.executable, "-m", "modelfleet", "engine-sim", "--model", "m", "--ttft", "0",
           "--itl", "0", "--prefill-per-token", "0"]  # fmt: skip
    procs = [
        subprocess.Popen([*sim, "--port", str(direct_port)], start_new_session=True),
        subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "engine-gate", "--listen",
             f"127.0.0.1:{gate_port}", "--engine-port", str(inner_port),
             "--cert", str(folder / "node.crt"), "--key", str(folder / "node.key"),
             "--ca", str(folder / "ca.crt"), "--", *sim, "--port", str(inner_port)],
            start_new_session=True,
        ),
    ]  # fmt: skip
    try:
        context = client_context_with(ca.cert_pem, ca.issue_router_client(now))
        direct, gated = f"http://127.0.0.1:{direct_port}", f"https://127.0.0.1:{gate_port}"
        wait_ready(direct, True)
        wait_ready(gated, context)

        async def both() -> dict[str, Any]:
            upstreams = Upstreams(connect_timeout=5)
            upstreams.use_tls(context, {gated: f"{NODE}.node.modelfleet.invalid"})
            try:
                return {
                    "direct": await measure(upstreams, direct, args.requests, args.concurrency),
                    "gated": await measure(upstreams, gated, args.requests, args.concurrency),
                }
            finally:
                upstreams.close()

        result = asyncio.run(both())
    finally:
        stop_groups([p.pid for p in procs], grace=10)
    result["gate_added_p50_ms"] = round(result["gated"]["p50_ms"] - result["direct"]["p50_ms"], 3)
    result["gate_throughput_ratio"] = round(
        result["gated"]["req_per_s"] / result["direct"]["req_per_s"], 3
    )
    json_line(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
