"""Per-key limits measured where they used to give way: the minute's boundary, clients that
hang up, a Redis that restarts, a Redis that hangs. Real Redis (Debian's redis-server) for
all of it; real routers and engine simulators for the last three.

- `max_window_over_limit`: 2 and 4 routers sharing one Redis, a key counted exactly (rpm
  150) and one leased (rpm 1,000), clients sending at three times the limit for three
  minutes. The largest count in any 60 s window, over the limit, as a fraction of it
  (target <= 0.10; the two-bucket estimate this replaced reached 0.98). The routers' limits
  run in this process on the clock this bench moves (each admission is given its time, as the
  router gives its wall clock), so three minutes take seconds; what is admitted depends on
  time through that alone.
- `tokens_charged_ratio`: clients that hang up 0.3 s into non-streamed answers of 100
  tokens: the tokens the router charged their key, over the tokens the engine spent on them
  (prompt and generated, its own counters). Target >= 0.95; it was about 0.1 (each was
  charged nothing).
- `leaked_slots_after_redis_restart`: a key of max_concurrent 4, four requests in flight
  while Redis is stopped and started again empty; once they ended, how many of four slots
  eight concurrent requests cannot get (target 0).
- `hung_redis_added_ms`: p50 latency of a key counted exactly, against an engine that
  answers at once, while Redis hangs (SIGSTOP) once the router's breaker is open, less the
  p50 while Redis answers (target <= 50; it was 1,060).

    python bench/limits.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import yaml
from kit import end_on_sigterm, json_line
from router import Processes, start_redis, start_sims, wait_ready

from modelfleet.host.files import write_atomic
from modelfleet.host.processes import free_port
from modelfleet.router.limits import RedisLimits, Ticket
from modelfleet.router.table import ApiKey

KEYS = {
    "exact": "sk-limits-exact-0123456789abcdef0123456789",
    "slots": "sk-limits-slots-0123456789abcdef0123456789",
    "hung": "sk-limits-hung-0123456789abcdef01234567890",
}


async def window_over(url: str, routers: int, rpm: int, rate: float = 3.0) -> float:
    """The largest count in any 60 s window over `rpm`, as a fraction of it."""
    prefix = f"bench:{uuid.uuid4().hex}:"
    made = []
    for _ in range(routers):
        limits = RedisLimits.from_url(url, sync_clock=False)
        limits.prefix = prefix
        made.append(limits)
    key = ApiKey("k", "h", rpm=rpm)
    rng = random.Random(routers * rpm)
    now = 1_800_000_000.0 + rng.uniform(0, 60)
    end, step = now + 180, 60 / (rpm * rate)
    admitted: list[float] = []
    while now < end:
        if isinstance(await rng.choice(made).admit(key, 0, "r", now), Ticket):
            admitted.append(now)
        now += step
    most, first = 0, 0
    for last, at in enumerate(admitted):  # every window that ends at an admission
        while admitted[first] <= at - 60:
            first += 1
        most = max(most, last - first + 1)
    for limits in made:
        await limits.close()
    return (most - rpm) / rpm


def start_router(procs: Processes, engine: str, instant: str, store: str) -> str:
    port, push = free_port("127.0.0.1"), free_port("127.0.0.1")
    config = {
        "port": port,
        "push_port": push,
        "limits_store": store,
        "models": [
            {"name": "m", "endpoints": [engine]},
            {"name": "instant", "endpoints": [instant]},
        ],
        "api_keys": [
            {"name": "exact", "key": KEYS["exact"], "rpm": 150, "tpm": 10**9},
            {"name": "slots", "key": KEYS["slots"], "rpm": 150, "max_concurrent": 4},
            {"name": "hung", "key": KEYS["hung"], "rpm": 199},
        ],
    }
    path = procs.tmp / "router.yaml"
    write_atomic(path, yaml.safe_dump(config))  # 0600: it holds tokens
    procs.start("router", [sys.executable, "-m", "modelfleet", "router", "--config", str(path)])
    url = f"http://127.0.0.1:{port}"
    wait_ready(procs, "the router", url + "/health")
    return url


def engine_spent(engine: str) -> float:
    """Prompt and generated tokens the simulator counted."""
    spent = 0.0
    for line in httpx.get(engine + "/metrics").text.splitlines():
        if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")):
            spent += float(line.split()[-1])
    return spent


async def hang_up(router: str, key: str, after: float) -> None:
    """Send a completion and hang up `after` seconds later, before its answer."""
    port = int(router.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "prompt": "tell me a story " * 10, "max_tokens": 100})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: r\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body.encode())
    await asyncio.sleep(after)
    writer.close()


def engine_running(engine: str) -> float:
    for line in httpx.get(engine + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    raise RuntimeError("the simulator reports no vllm:num_requests_running")


async def until_engine(engine: str, running: int, what: str) -> None:
    deadline = time.monotonic() + 30
    while engine_running(engine) != running:
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited 30 s for {what}")
        await asyncio.sleep(0.05)


async def tokens_charged_ratio(router: str, engine: str, store: str) -> float:
    import redis.asyncio

    before = engine_spent(engine)
    for _ in range(4):
        await asyncio.gather(*(hang_up(router, KEYS["exact"], 0.3) for _ in range(10)))
    await until_engine(engine, 0, "the engine to drop every request whose client hung up")
    client = redis.asyncio.Redis.from_url(store)
    charged = sum(int(v) for v in await client.hvals("modelfleet:limits:exact:tokens"))
    await client.aclose()
    return charged / (engine_spent(engine) - before)


async def slow(c: httpx.AsyncClient, key: str) -> int:
    body = {"model": "m", "prompt": "x", "max_tokens": 60}
    answer = await c.post("/v1/completions", json=body, headers=_auth(key))
    return answer.status_code


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def leaked_slots(
    router: str, engine: str, procs: Processes, redis_pid: int, port: int
) -> int:
    async with httpx.AsyncClient(base_url=router, timeout=60) as c:
        running = [asyncio.ensure_future(slow(c, KEYS["slots"])) for _ in range(4)]
        await until_engine(engine, 4, "the four requests to reach the engine")
        os.killpg(redis_pid, signal.SIGTERM)
        await asyncio.gather(*running)  # they end while Redis is down: their settlements fail
        start_redis(procs, port)  # again, empty
        # The router's probe finds Redis again within a second, and its next renewal (every
        # 10 s) sends the failed settlements again.
        await asyncio.sleep(12)
        statuses = await asyncio.gather(*(slow(c, KEYS["slots"]) for _ in range(8)))
    return 4 - statuses.count(200)


async def hung_added_ms(router: str, redis_pid: int) -> float:
    async def p50(c: httpx.AsyncClient, n: int) -> float:
        took = []
        body = {"model": "instant", "prompt": "x", "max_tokens": 1}
        for _ in range(n):
            began = time.perf_counter()
            answer = await c.post("/v1/completions", json=body, headers=_auth(KEYS["hung"]))
            took.append(time.perf_counter() - began)
            assert answer.status_code == 200, answer.text
        return statistics.median(took) * 1000

    async with httpx.AsyncClient(base_url=router, timeout=30) as c:
        healthy = await p50(c, 60)
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            await p50(c, 3)  # the timeouts that open the breaker
            hung = await p50(c, 60)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
    print(f"  p50 while Redis answers {healthy:.2f} ms, while it hangs {hung:.2f} ms")
    return hung - healthy


def main() -> None:
    end_on_sigterm()
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp:
        procs = Processes(Path(tmp))
        try:
            store, redis_pid = start_redis(procs)
            port = int(store.rsplit(":", 1)[1].split("/")[0])
            over = []
            for routers in (2, 4):
                for kind, rpm in (("exact", 150), ("leased", 1000)):
                    fraction = asyncio.run(window_over(store, routers, rpm))
                    print(f"{routers} routers, {kind} rpm {rpm}: worst 60 s window {fraction:+.3f}")
                    over.append(fraction)
            figures["max_window_over_limit"] = round(max(over), 4)
            (engine,) = start_sims(procs, 1, "--itl", "0.02", "--ttft", "0.05")
            (instant,) = start_sims(procs, 1, "--model", "instant")
            router = start_router(procs, engine, instant, store)
            ratio = asyncio.run(tokens_charged_ratio(router, engine, store))
            print(f"clients that hang up: charged {ratio:.2f} of what the engine spent")
            figures["tokens_charged_ratio"] = round(ratio, 3)
            hung = asyncio.run(hung_added_ms(router, redis_pid))
            figures["hung_redis_added_ms"] = round(hung, 2)
            leaked = asyncio.run(leaked_slots(router, engine, procs, redis_pid, port))
            print(f"slots lost to a restart of Redis: {leaked} of 4")
            figures["leaked_slots_after_redis_restart"] = leaked
        finally:
            procs.stop_all()
    json_line(figures)


if __name__ == "__main__":
    main()
