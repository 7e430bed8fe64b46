"""LoRA adapters: how often a request finds its adapter loaded, how many loads the fleet makes
against a router that picks replicas at random, and what a restart and a bad source cost.

Starts a fleet as `modelfleet up` does (control plane, router, two agents of simulated GPUs) in
a temporary folder: one base model of 2 replicas with `max_loras: 4` and 50 adapters, on
simulated engines that take 0.5 s to load an adapter. Then, with the official `openai` client:

1. 40 requests a second for `--duration` seconds, each naming an adapter drawn from a Zipf
   distribution (s = 1.1; which adapter is how popular is shuffled, so the catalog's order
   gives no head start). `adapter_hit_ratio`: the share of requests served by the replica
   they were sent to, which already held their adapter (the router sends a request only to a
   replica holding its adapter; one it sent on after that replica's 404, in the moment a swap
   takes, counts as a miss: `modelfleet_router_retries_total`). Against it, `random_hit_ratio`:
   the share of the random router's requests that found their adapter where they were sent.
   `found_loaded_ratio`: the share that found their adapter loaded somewhere when they came,
   the others held by the router until the control plane had it loaded
   (`modelfleet_router_held_total`). `failed`: requests not answered 200.
2. The same requests, at the same pace, to two engines of their own behind a router that
   picks one at random and, like an engine that loads adapters on demand, loads an adapter
   where a request finds it missing. `loads_vs_random`: the fleet's loads (the engines'
   `sim:lora_loads_total`) over that router's (target <= 0.3).
3. One replica's engine is killed: `reload_after_restart_s` is from its new engine being
   ready to every adapter it holds being loaded again (target <= 1 s).
4. An adapter whose source does not exist is added and asked for: `failed_load_reported` is
   whether it shows as failed with the engine's message (`ctl replicas show`) and its request
   is answered 503 `adapter-failed` with that message.

With 8 slots for 50 adapters, no policy can have more requests find their adapter loaded when
they come than the 8 most popular adapters' share (printed as `found_loaded_bound`, 0.656 at
s = 1.1): the others must wait for a load.

Ends with one JSON line.

    python bench/lora.py [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from kit import AdminFleet, answers, end_on_sigterm, json_line, wait

from modelfleet.host.processes import free_port, stop_groups
from modelfleet.up import FleetOptions, RunningFleet, start_fleet

ADAPTERS = [f"lora-{i:02d}" for i in range(50)]
LOAD_DELAY_S = 0.5
MAX_LORAS = 4
SIM = ["--ttft", "0.03", "--itl", "0.01", "--lora-load-delay", str(LOAD_DELAY_S)]
BASE: dict[str, Any] = {
    "name": "base",
    "engine": "sim",
    "args": SIM,
    "replicas": 2,
    "max_loras": MAX_LORAS,
    "adapters": [{"name": a, "source": f"org/{a}"} for a in ADAPTERS],
}
RATE, ZIPF_S, SEED = 40.0, 1.1, 7
ERRORS: dict[str, int] = {}  # why requests through the fleet failed, and how often


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return wait(what, check, timeout, every=0.02, ignore=(httpx.TransportError,))


def workload(duration: float) -> list[str]:
    """The adapters asked for, one per request at RATE a second: Zipf over a shuffled order."""
    rng = random.Random(SEED)
    order = ADAPTERS[:]
    rng.shuffle(order)
    weights = [k**-ZIPF_S for k in range(1, len(order) + 1)]
    return rng.choices(order, weights, k=int(duration * RATE))


def found_loaded_bound() -> float:
    weights = sorted((k**-ZIPF_S for k in range(1, len(ADAPTERS) + 1)), reverse=True)
    return float(sum(weights[: 2 * MAX_LORAS]) / sum(weights))


async def paced(asks: list[str], send: Callable[[str], Any]) -> list[tuple[bool, float]]:
    """Send one request per entry of `asks` at RATE a second, open loop; for each, whether
    it succeeded and how long it took."""
    began = time.monotonic()
    tasks = []

    async def timed(adapter: str) -> tuple[bool, float]:
        start = time.monotonic()
        ok = await send(adapter)
        return ok, time.monotonic() - start

    for i, adapter in enumerate(asks):
        delay = began + i / RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(adapter)))
    return list(await asyncio.gather(*tasks))


def percentiles(done: list[tuple[bool, float]], prefix: str) -> dict[str, float]:
    took = sorted(t for _, t in done)
    at = {50: took[len(took) // 2], 99: took[min(len(took) - 1, len(took) * 99 // 100)]}
    return {f"{prefix}_p{p}_s": round(v, 3) for p, v in at.items()}


class Fleet(AdminFleet):
    def __init__(self, running: RunningFleet) -> None:
        super().__init__(running, timeout=30)

    def adapters(self, replica: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {a["name"]: a for a in replica["shards"][0]["adapters"]}

    def scrape(self, url: str, name: str, token: str | None = None) -> dict[str, float]:
        """Samples of metric `name` at `url` (asked with `token`): labels (as text) -> value."""
        found = {}
        auth = {"authorization": f"Bearer {token}"} if token else {}
        for line in httpx.get(url, headers=auth, timeout=10).text.splitlines():
            if line.startswith(name):
                labels, _, value = line.rpartition(" ")
                found[labels] = float(value)
        return found

    def engine_loads(self) -> float:
        return sum(
            sum(self.scrape(r["endpoint"] + "/metrics", "sim:lora_loads_total").values())
            for r in self.replicas()
            if r["endpoint"]
        )

    def router_count(self, name: str) -> float:
        """Metric `name` of the router, summed over the adapters."""
        running = self.running
        samples = self.scrape(running.push_url + "/metrics", name, running.admin_token)
        return sum(v for labels, v in samples.items() if "lora-" in labels)


def client(base_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=600.0)


async def through_fleet(fleet: Fleet, asks: list[str]) -> list[tuple[bool, float]]:
    api = client(fleet.running.router_url, fleet.running.api_key)

    async def send(adapter: str) -> bool:
        try:
            await api.completions.create(model=adapter, prompt="Hi", max_tokens=8)
        except openai.APIError as exc:
            why = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:160]
            ERRORS[why] = ERRORS.get(why, 0) + 1
            return False
        return True

    try:
        return await paced(asks, send)
    finally:
        await api.close()


async def through_random_router(
    engines: list[str], asks: list[str]
) -> tuple[int, int, list[tuple[bool, float]]]:
    """The same requests to `engines` picked at random, loading an adapter where a request
    finds it missing (a 404); returns the loads made, the requests that found their adapter
    at once, and how each request went."""
    loads = hits = 0
    rng = random.Random(SEED)
    async with httpx.AsyncClient(timeout=600) as http:

        async def send(adapter: str) -> bool:
            nonlocal loads, hits
            engine = rng.choice(engines)
            for attempt in range(20):
                body = {"model": adapter, "prompt": "Hi", "max_tokens": 8}
                answer = await http.post(engine + "/v1/completions", json=body)
                if answer.status_code != 404:
                    hits += attempt == 0 and answer.status_code == 200
                    return answer.status_code == 200
                load = {"lora_name": adapter, "lora_path": f"org/{adapter}"}
                loaded = await http.post(engine + "/v1/load_lora_adapter", json=load)
                loads += loaded.status_code == 200
                if loaded.status_code != 200:  # another request's load of it is under way
                    await asyncio.sleep(0.1)
            return False

        done = await paced(asks, send)
    return loads, hits, done


def random_router(asks: list[str], folder: Path) -> tuple[int, int, list[tuple[bool, float]]]:
    procs, urls = [], []
    env = {k: v for k, v in os.environ.items() if k != "MODELFLEET_ENGINE_KEY"}
    try:
        for i in range(2):
            port = free_port("127.0.0.1")
            argv = [sys.executable, "-m", "modelfleet", "engine-sim", "--model", "base",
                    "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
                    "--max-loras", str(MAX_LORAS), *SIM]  # fmt: skip
            with open(folder / f"random-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_for(f"{url} ready", functools.partial(answers, url + "/health"))
        return asyncio.run(through_random_router(urls, asks))
    finally:
        stop_groups([p.pid for p in procs], 10)


def restart(fleet: Fleet) -> float:
    """Kill one replica's engine: seconds from its new engine ready to all its adapters."""
    replica = fleet.replicas()[0]
    pid = replica["shards"][0]["pid"]
    os.kill(pid, signal.SIGKILL)

    def seen() -> dict[str, Any] | None:
        return next(r for r in fleet.replicas() if r["id"] == replica["id"])

    ready: float = wait_for(
        "the new engine ready",
        lambda: (r := seen()) and r["state"] == "ready" and r["shards"][0]["pid"] != pid
        and time.monotonic(),
    )  # fmt: skip
    wait_for(
        "its adapters loaded again",
        lambda: (r := seen()) and all(a["state"] == "loaded" for a in fleet.adapters(r).values()),
    )
    return time.monotonic() - ready


def bad_source(fleet: Fleet, folder: Path) -> tuple[bool, str]:
    """Add an adapter whose source does not exist and ask for it."""
    catalog = {"models": [{**BASE, "adapters": [*BASE["adapters"],
               {"name": "missing", "source": str(folder / "no-such-lora")}]}]}  # fmt: skip
    answer = fleet.admin.put("/v1/catalog", content=yaml.safe_dump(catalog))
    assert answer.status_code == 200, answer.text
    wait_for("missing in the routers' tables", lambda: "missing" in [
        m["id"] for m in httpx.get(fleet.running.router_url + "/v1/models",
        headers={"authorization": f"Bearer {fleet.running.api_key}"}).json()["data"]])  # fmt: skip
    refused = httpx.post(
        fleet.running.router_url + "/v1/completions",
        json={"model": "missing", "prompt": "Hi", "max_tokens": 8},
        headers={"authorization": f"Bearer {fleet.running.api_key}"},
        timeout=120,
    )
    said = refused.json().get("error", {}).get("message", "")
    answered = (
        refused.status_code == 503
        and refused.headers.get("x-modelfleet-reason") == "adapter-failed"
        and "No adapter found" in said
    )
    shown = any(
        (a := fleet.adapters(r).get("missing")) is not None
        and a["state"] == "failed"
        and "No adapter found" in a["error"]
        for r in fleet.replicas()
    )
    return answered and shown, said


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument(
        "--keep", action="store_true", help="keep the fleet's folder (its logs) and say where"
    )
    args = parser.parse_args()
    asks = workload(args.duration)
    results: dict[str, Any] = {
        "requests": len(asks),
        "found_loaded_bound": round(found_loaded_bound(), 3),
    }
    prefix = "mf-bench-lora-"
    place = (
        contextlib.nullcontext(tempfile.mkdtemp(prefix=prefix))
        if args.keep
        else tempfile.TemporaryDirectory(prefix=prefix)
    )
    with place as tmp:
        folder = Path(tmp)
        if args.keep:
            results["kept"] = tmp
        state = folder / "state"
        state.mkdir()
        (state / "catalog.yaml").write_text(yaml.safe_dump({"models": [BASE]}))
        running = start_fleet(state, FleetOptions(gpus="1x80GB", report_interval=1.0))
        try:
            fleet = Fleet(running)
            wait_for("8 adapters loaded on 2 replicas", lambda: sum(
                a["state"] == "loaded" for r in fleet.replicas()
                for a in fleet.adapters(r).values()) == 2 * MAX_LORAS)  # fmt: skip
            loads_before = fleet.engine_loads()
            held_before = fleet.router_count("modelfleet_router_held_total")
            resent_before = fleet.router_count("modelfleet_router_retries_total")
            began = time.monotonic()
            done = asyncio.run(through_fleet(fleet, asks))
            took = time.monotonic() - began
            loads = fleet.engine_loads() - loads_before
            held = fleet.router_count("modelfleet_router_held_total") - held_before
            resent = fleet.router_count("modelfleet_router_retries_total") - resent_before
            results.update(
                adapter_hit_ratio=round(1 - resent / len(asks), 3),
                found_loaded_ratio=round(1 - held / len(asks), 3),
                failed=sum(not ok for ok, _ in done),
                **percentiles(done, "latency"),
                fleet_loads=int(loads),
                fleet_s=round(took, 1),
            )
            random_loads, random_hits, random_done = random_router(asks, folder)
            results.update(
                random_hit_ratio=round(random_hits / len(asks), 3),
                random_loads=random_loads,
                **percentiles(random_done, "random_latency"),
                loads_vs_random=round(loads / max(1, random_loads), 3),
            )
            results["reload_after_restart_s"] = round(restart(fleet), 3)
            reported, said = bad_source(fleet, folder)
            results.update(failed_load_reported=reported, failed_load_message=said)
            results["errors"] = dict(sorted(ERRORS.items(), key=lambda kv: -kv[1])[:3])
        finally:
            running.fleet.stop()
    json_line(results)


if __name__ == "__main__":
    main()
