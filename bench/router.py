"""The router's data path side by side with its peers, in one run on this machine.

Two engine simulators at zero latency (no time to first token, none between tokens) serve
model `m`. The same load goes, one target after another, straight to the engines (the
client alternates between them), through the modelfleet router, through vllm-router and
through the LiteLLM proxy (each peer from its own venv, made by `bench/make_peers.sh`; a peer
that is not there is left out and said so). For each target:

- open loop at each `--rates` (requests/s), streamed and not: latency p50/p99, and the
  router's CPU (user + sys of its whole process tree, from /proc) per request. Each target
  gets its `--duration` in `--rounds` turns, the targets taking turns in alternating order,
  so that a spell of noise on this shared machine falls on all of them alike;
- closed loop, `--clients` clients on kept-alive connections: requests/s at saturation;
- its RSS after the load.

Then the modelfleet router again with 1,000 API keys, each limited (requests and tokens per
minute, requests at once, all far above what the load reaches, so that every request is
checked and settled and none refused), the counts in a Redis server (Debian's redis-server)
as several routers would share them; the load spreads over all 1,000 keys. Its CPU includes
the Redis server's.

Then prefix affinity: four simulators with a slow prefill and a prefix cache that holds 12 of
the workload's 32 long prefixes (each request one of them and a short suffix of its own): the
fleet's caches hold them all only if each prefix keeps to one engine.
Time to the first token through modelfleet with `routing: prefix`, through modelfleet with
`least_load`, and through vllm-router's round robin.

It ends with one JSON line: `added_p50_ms`, `added_p99_ms` (over direct, open loop at the
lowest rate, not streamed), `cpu_ms_per_req`, `max_rps`, `rss_mb`, the same prefixed
`vllm_router_` and `litellm_`, the same prefixed `limits_` for the router with 1,000 limited
keys, and `prefix_ttft_p50_gain` (round robin's p50 over prefix affinity's).

    bash bench/make_peers.sh      # once: the peers' venvs
    python bench/router.py [--duration 10] [--rates 50,200] [--clients 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from kit import answers, end_on_sigterm, json_line, wait

from modelfleet.host.files import write_atomic
from modelfleet.host.processes import free_port

HERE = Path(__file__).resolve().parent
VENVS = HERE / ".venvs"
KEY = "sk-bench-0123456789abcdef0123456789abcdef"  # LiteLLM wants a strong master key
MODEL = "m"
PUSH_TOKEN = "push-bench-0123456789abcdef"  # a modelfleet router's push API (its metrics)


@dataclass
class Target:
    """One way to reach the engines: a name, base URLs the client spreads over, the
    processes whose CPU and memory count as the router's."""

    name: str
    urls: list[str]
    pids: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=lambda: [KEY])  # requests take them in turn
    metrics: str | None = None  # a modelfleet router's metrics (its push API, PUSH_TOKEN)

    def cpu_seconds(self) -> float:
        total = 0.0
        for proc in _tree(self.pids):
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
        return total

    def rss_mb(self) -> float:
        total = 0
        for proc in _tree(self.pids):
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total / 2**20


def _tree(pids: list[int]) -> Iterator[psutil.Process]:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            yield root
            yield from root.children(recursive=True)


class Processes:
    """Every process this bench starts, each in its own group, all ended at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.started.append(proc)
        return proc.pid

    def stop_all(self) -> None:
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.started:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_ready(procs: Processes, what: str, url: str, timeout: float = 120.0) -> None:
    """Wait until GET `url` answers 200; fail naming `what` after `timeout` s, or at once
    when a process this bench started has exited."""

    def ready() -> bool:
        for proc in procs.started:
            if proc.poll() is not None:
                argv = proc.args if isinstance(proc.args, list) else [proc.args]
                raise RuntimeError(f"{argv[0]!s} exited ({proc.returncode}); see {procs.tmp}")
        return answers(url)

    wait(f"{what} to answer {url}", ready, timeout, every=0.1)


def start_sims(procs: Processes, n: int, *extra: str) -> list[str]:
    urls = []
    for i in range(n):
        port = free_port("127.0.0.1")
        procs.start(
            f"sim-{port}",
            [sys.executable, "-m", "modelfleet", "engine-sim", "--model", MODEL,
             "--port", str(port), "--ttft", "0", "--itl", "0", "--prefill-per-token", "0",
             "--max-concurrency", "1000", "--log-level", "warning", *extra],
        )  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
        del i
    for url in urls:
        wait_ready(procs, "an engine simulator", url + "/health")
    return urls


def start_redis(procs: Processes, port: int = 0) -> tuple[str, int]:
    """Debian's redis-server on `port` (0: a free one), nothing saved: its URL and pid."""
    port = port or free_port("127.0.0.1")
    pid = procs.start(
        f"redis-{port}-{len(procs.started)}",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(procs.tmp)],
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return f"redis://127.0.0.1:{port}/0", pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not answer PING; see {procs.tmp}")
        time.sleep(0.05)


LIMITED_KEYS = [f"sk-bench-limited-{i:04d}-0123456789abcdef" for i in range(1000)]


def start_modelfleet(
    procs: Processes,
    engines: list[str],
    routing: str = "least_load",
    limits_store: str = "",
    name: str = "modelfleet",
    env: dict[str, str] | None = None,
    **config_extra: Any,
) -> Target:
    """A modelfleet router in front of `engines`, known as `name`; `env` for its process
    (another modelfleet on PYTHONPATH, say), `config_extra` more of its config."""
    port, push = free_port("127.0.0.1"), free_port("127.0.0.1")
    config: dict[str, Any] = {
        "port": port,
        "push_port": push,
        "push_token": PUSH_TOKEN,
        "api_keys": [{"name": "bench", "key": KEY}],
        "models": [{"name": MODEL, "endpoints": engines, "routing": routing}],
        **config_extra,
    }
    if limits_store:
        config["limits_store"] = limits_store
        config["api_keys"] = [
            {"name": f"key-{i}", "key": key, "rpm": 10**6, "tpm": 10**9, "max_concurrent": 10**4}
            for i, key in enumerate(LIMITED_KEYS)
        ]
    path = procs.tmp / f"router-{port}.yaml"
    write_atomic(path, yaml.safe_dump(config))  # 0600: it holds tokens
    pid = procs.start(
        f"{name}-{port}",
        [sys.executable, "-m", "modelfleet", "router", "--config", str(path),
         "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(procs, "the modelfleet router", url + "/health")
    # /v1/metrics: where routers before and after /metrics moved off the client port serve it.
    metrics = f"http://127.0.0.1:{push}/v1/metrics"
    if limits_store:
        return Target("limits", [url], [pid], LIMITED_KEYS, metrics)
    return Target(name, [url], [pid], metrics=metrics)


def start_vllm_router(procs: Processes, engines: list[str], policy: str) -> Target | None:
    binary = VENVS / "vllm-router" / "bin" / "vllm-router"
    if not binary.exists():
        return None
    port, prom = free_port("127.0.0.1"), free_port("127.0.0.1")
    pid = procs.start(
        f"vllm-router-{port}",
        [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines,
         "--policy", policy, "--prometheus-port", str(prom), "--log-level", "warning"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(procs, "vllm-router", url + "/health")
    return Target("vllm_router", [url], [pid])


def start_litellm(procs: Processes, engines: list[str]) -> Target | None:
    binary = VENVS / "litellm" / "bin" / "litellm"
    if not binary.exists():
        return None
    port = free_port("127.0.0.1")
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"{e}/v1",
                    "api_key": "x",
                },
            }
            for e in engines
        ],
        "litellm_settings": {"telemetry": False},
    }
    path = procs.tmp / "litellm.yaml"
    write_atomic(path, yaml.safe_dump(config))  # 0600: it holds tokens
    pid = procs.start(
        "litellm",
        [str(binary), "--config", str(path), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        env={
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_MASTER_KEY": KEY,
        },
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(procs, "the LiteLLM proxy", url + "/health/liveliness", timeout=180)
    return Target("litellm", [url], [pid])


# -- load ---------------------------------------------------------------------------------


def _body(stream: bool, prompt: str = "hello there", max_tokens: int = 8) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, key: str = KEY
) -> tuple[float, float, bool]:
    """One completion: (seconds to its end, seconds to its first text, whether it succeeded)."""
    start = time.perf_counter()
    first = None
    try:
        async with session.post(url + "/v1/completions", data=body, headers=_headers(key)) as r:
            if stream:
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter()
            else:
                await r.read()
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False  # LiteLLM, overloaded, leaves some unanswered past the client's timeout
    end = time.perf_counter()
    return end - start, (first or end) - start, ok


@dataclass
class Samples:
    """What open-loop requests to one target gave: their times and the CPU they cost."""

    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    failed: int = 0
    cpu_seconds: float = 0.0

    def add(self, other: Samples) -> None:
        self.latencies += other.latencies
        self.firsts += other.firsts
        self.failed += other.failed
        self.cpu_seconds += other.cpu_seconds

    def figures(self) -> dict[str, Any]:
        n = len(self.latencies)
        latencies, firsts = sorted(self.latencies), sorted(self.firsts)
        return {
            "n": n,
            "failed": self.failed,
            "p50_ms": _pct(latencies, 50) * 1000,
            "p99_ms": _pct(latencies, 99) * 1000,
            "ttft_p50_ms": _pct(firsts, 50) * 1000,
            "ttft_p99_ms": _pct(firsts, 99) * 1000,
            "cpu_ms_per_req": self.cpu_seconds * 1000 / max(1, n),
        }


async def open_loop_samples(
    target: Target, rate: float, duration: float, stream: bool, bodies: list[bytes] | None = None
) -> Samples:
    """Requests at `rate`/s for `duration` s, each started on time whatever the others do."""
    n = max(1, int(rate * duration))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _one(session, target.urls[0], _body(stream), stream, target.keys[0])  # warm up
        cpu0 = target.cpu_seconds()
        start = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = bodies[i % len(bodies)] if bodies else _body(stream)
            url = target.urls[i % len(target.urls)]
            key = target.keys[i % len(target.keys)]
            tasks.append(asyncio.create_task(_one(session, url, body, stream, key)))
        results = await asyncio.gather(*tasks)
        cpu = target.cpu_seconds() - cpu0
    return Samples(
        [r[0] for r in results], [r[1] for r in results], sum(not r[2] for r in results), cpu
    )


async def open_loop(
    target: Target, rate: float, duration: float, stream: bool, bodies: list[bytes] | None = None
) -> dict[str, Any]:
    return (await open_loop_samples(target, rate, duration, stream, bodies)).figures()


def open_loop_interleaved(
    targets: list[Target], rate: float, duration: float, stream: bool, rounds: int
) -> dict[str, dict[str, Any]]:
    """`duration` s of open loop per target, in `rounds` turns taken in alternating order
    (A B C, then C B A, ...): a machine that is slower for a while slows every target
    alike, instead of whichever one's phase it fell in."""
    pooled = {t.name: Samples() for t in targets}
    for turn in range(rounds):
        order = targets if turn % 2 == 0 else targets[::-1]
        for target in order:
            got = asyncio.run(open_loop_samples(target, rate, duration / rounds, stream))
            pooled[target.name].add(got)
    return {name: samples.figures() for name, samples in pooled.items()}


async def closed_loop(target: Target, clients: int, duration: float) -> dict[str, Any]:
    """`clients` clients, each sending its next request when its last one is answered, on
    kept-alive connections: requests/s at saturation."""
    connector = aiohttp.TCPConnector(limit=clients)
    body = _body(False)
    done = failed = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        cpu0 = target.cpu_seconds()
        end = time.perf_counter() + duration

        async def client(i: int) -> None:
            nonlocal done, failed
            url = target.urls[i % len(target.urls)]
            turn = i
            while time.perf_counter() < end:
                key = target.keys[turn % len(target.keys)]
                turn += clients
                _, _, ok = await _one(session, url, body, False, key)
                done += 1
                failed += not ok

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
        cpu = target.cpu_seconds() - cpu0
    return {
        "rps": done / elapsed,
        "failed": failed,
        "cpu_ms_per_req": cpu * 1000 / max(1, done),
    }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100))]


# -- the run ------------------------------------------------------------------------------


def measure(
    targets: list[Target], rates: list[float], duration: float, clients: int, rounds: int
) -> dict[str, dict[str, Any]]:
    phases: dict[str, dict[str, Any]] = {t.name: {} for t in targets}
    # Saturation first: a router that falls behind in an open loop (LiteLLM does) would
    # still be working off that backlog in the closed loop after it.
    for target in targets:
        phases[target.name]["closed"] = asyncio.run(closed_loop(target, clients, duration))
        _say(target.name, "closed", phases[target.name]["closed"])
    for rate in rates:
        for stream in (False, True):
            key = f"open_{rate:g}{'_stream' if stream else ''}"
            got = open_loop_interleaved(targets, rate, duration, stream, rounds)
            for target in targets:
                phases[target.name][key] = got[target.name]
                _say(target.name, key, got[target.name])
    for target in targets:
        phases[target.name]["rss_mb"] = target.rss_mb()
    return phases


def _say(name: str, phase: str, figures: dict[str, Any]) -> None:
    shown = ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()
    )
    print(f"  {name:12} {phase:16} {shown}", flush=True)


def prefix_workload(prefixes: int, words: int, requests: int, seed: int = 7) -> list[bytes]:
    """Requests sharing `prefixes` long prompts, each with a short suffix of its own."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    heads = [
        f"document {p} " + " ".join(rng.choice(vocab) for _ in range(words))
        for p in range(prefixes)
    ]
    bodies = []
    for i in range(requests):
        head = heads[rng.randrange(prefixes)]
        prompt = f"{head} question {i} " + " ".join(rng.choice(vocab) for _ in range(16))
        bodies.append(_body(True, prompt, max_tokens=1))
    return bodies


def run_prefix(procs: Processes, args: argparse.Namespace) -> dict[str, Any]:
    """The same prefix workload through each router, each time to four fresh engines (cold
    caches: no router inherits what the one before it warmed)."""
    requests = int(args.prefix_rate * args.prefix_duration)
    bodies = prefix_workload(prefixes=32, words=2000, requests=requests)
    starts: dict[str, Callable[[list[str]], Target | None]] = {
        "modelfleet_prefix": lambda e: start_modelfleet(procs, e, "prefix"),
        "modelfleet_least_load": lambda e: start_modelfleet(procs, e, "least_load"),
        "vllm_router_round_robin": lambda e: start_vllm_router(procs, e, "round_robin"),
    }
    results: dict[str, Any] = {}
    for name, start in starts.items():
        engines = start_sims(
            procs, 4, "--ttft", "0.01", "--prefill-per-token", "0.0003",
            "--prefix-cache-blocks", "1536",
        )  # fmt: skip
        target = start(engines)
        if target is None:
            print(f"  {name}: not measured (run bench/make_peers.sh)")
            continue
        results[name] = asyncio.run(
            open_loop(target, args.prefix_rate, args.prefix_duration, True, bodies)
        )
        _say(name, f"prefix_{args.prefix_rate:g}", results[name])
    return results


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--rates", default="50,200", help="open-loop requests/s, comma-separated")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--prefix-rate", type=float, default=10.0, help="requests/s, prefix phase")
    parser.add_argument("--prefix-duration", type=float, default=30.0, help="seconds, prefix phase")
    parser.add_argument(
        "--rounds", type=int, default=5, help="open-loop turns per target, interleaved"
    )
    parser.add_argument(
        "--skip", default="", help="targets to leave out: litellm,vllm_router,limits"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    skip = set(filter(None, args.skip.split(",")))

    tmp = Path(tempfile.mkdtemp(prefix="modelfleet-bench-router-"))
    procs = Processes(tmp)
    figures: dict[str, dict[str, Any]] = {}
    try:
        engines = start_sims(procs, 2)
        targets: list[Target | None] = [Target("direct", engines), start_modelfleet(procs, engines)]
        if "vllm_router" not in skip:
            targets.append(start_vllm_router(procs, engines, "round_robin"))
        if "litellm" not in skip:
            targets.append(start_litellm(procs, engines))
        if "limits" not in skip:
            store, redis_pid = start_redis(procs)
            limited = start_modelfleet(procs, engines, limits_store=store)
            limited.pids.append(redis_pid)
            targets.append(limited)
        print(f"open loop {args.rates} req/s and closed loop {args.clients} clients, "
              f"{args.duration:g} s each; logs in {tmp}")  # fmt: skip
        present = [t for t in targets if t is not None]
        figures = measure(present, rates, args.duration, args.clients, args.rounds)
        print(
            "prefix affinity: 32 prefixes of 2,000 tokens over 4 engines, each caching 1,536 "
            "blocks of 16 tokens (12 prefixes)"
        )
        prefix = run_prefix(procs, args)
    finally:
        procs.stop_all()

    base = f"open_{rates[0]:g}"
    direct = figures["direct"]
    line: dict[str, Any] = {}
    for name, prefix_key in (
        ("modelfleet", ""),
        ("vllm_router", "vllm_router_"),
        ("litellm", "litellm_"),
        ("limits", "limits_"),
    ):
        got = figures.get(name)
        if got is None:
            continue
        line[prefix_key + "added_p50_ms"] = round(got[base]["p50_ms"] - direct[base]["p50_ms"], 3)
        line[prefix_key + "added_p99_ms"] = round(got[base]["p99_ms"] - direct[base]["p99_ms"], 3)
        line[prefix_key + "cpu_ms_per_req"] = round(
            statistics.mean(v["cpu_ms_per_req"] for k, v in got.items() if k.startswith("open_")), 3
        )
        line[prefix_key + "max_rps"] = round(got["closed"]["rps"], 1)
        line[prefix_key + "rss_mb"] = round(got["rss_mb"], 1)
    line["direct_max_rps"] = round(direct["closed"]["rps"], 1)
    if "modelfleet_prefix" in prefix:
        ours = prefix["modelfleet_prefix"]["ttft_p50_ms"]
        rr = prefix.get("vllm_router_round_robin") or prefix["modelfleet_least_load"]
        line["prefix_ttft_p50_ms"] = round(ours, 1)
        line["round_robin_ttft_p50_ms"] = round(rr["ttft_p50_ms"], 1)
        line["least_load_ttft_p50_ms"] = round(prefix["modelfleet_least_load"]["ttft_p50_ms"], 1)
        line["prefix_ttft_p50_gain"] = round(rr["ttft_p50_ms"] / ours, 2)
    json_line(line)


if __name__ == "__main__":
    main()
