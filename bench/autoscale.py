"""Replicas that follow the load: cold starts, the spread of held requests, how fast a scale-up
is decided, flapping, GPU-seconds saved, and waking a sleeping replica.

Starts a fleet as `modelfleet up` does (control plane, router, two agents of 8 simulated GPUs
each) in a temporary folder, with simulated engines of a small real model's speed (`--ttft
0.03 --itl 0.01`, 5 s to start), and drives it with the official `openai` client (streamed, so
that the time to first token is seen). Each phase has a model of its own:

1. `cold` (min 0, max 2, target 4, to zero after 6 s idle): 5 cycles of a burst of 50
   requests, then idle until it is at zero replicas again. `cold_start_failed` (target 0),
   `cold_first_token_s`: p50 over the cycles of the burst's first token (target <= the
   startup delay + 1 s).
2. `spread` (min 0, max 2, target 8): 100 requests at once on zero replicas, held while two
   replicas start; `release_spread` is the share the busiest replica served (target <= 0.6).
3. `up` (min 1, max 3, target 4, scale_up_after at its default 2 s): from 12 requests in
   flight (3 times the target: a burst, which goes up after half of scale_up_after) to a
   second replica placed: `scale_up_decision_s` (KEDA polls every 15 s; Ray Serve waits 30 s
   by default). And `edge` (the same bounds) from 5 requests in flight, just over the target,
   which goes up after the whole scale_up_after: `scale_up_decision_over_s`.
4. `wave` (min 1, max 4, target 4, scale_down_after 30 s): load alternating 40 and 4
   requests/s every 20 s for 3 minutes. `square_wave_flaps`: scale-downs undone within one
   period (target 0), and `slo_attainment`: the share of its requests with a first token
   within 2 s.
5. `nap` (min 0, max 1, idle_action: sleep, wake delay 1 s): once asleep, a request;
   `wake_s` from the request to its answer (target <= the wake delay + 0.5 s).
6. `coldload` (min 0, max 3, target 4, cold_timeout 3 s) under 80 closed-loop clients from
   zero, then `warmload` (the same, but min 3, all serving first) under the same load.
   `cold_load_503`: requests refused once the first answer came (target 0);
   `cold_vs_warm_throughput`: answers per second over `--load-s` from the first answer, over
   the same from warm (target >= 0.9).

Over the whole run, the replicas in the table are sampled every half second (a sleeping one
too: at sleep level 1 it keeps its GPU): `gpu_seconds_saved` is what every model at its
`max` for the same time would have held, less what was held (one GPU per replica here).

Ends with one JSON line.

    python bench/autoscale.py [--cycles 5] [--wave-s 180] [--load-s 20]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import yaml
from kit import AdminFleet, answered, end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.up import FleetOptions, RunningFleet, start_fleet

SIM = ["--ttft", "0.03", "--itl", "0.01", "--startup-delay", "5"]
STARTUP_S, WAKE_S = 5.0, 1.0
MODELS: list[dict[str, Any]] = [
    {"name": "cold", "engine": "sim", "args": SIM, "max_parallel": 2,
     "autoscale": {"min": 0, "max": 2, "target_in_flight": 4, "scale_down_after": "3s",
                   "scale_to_zero_after": "6s"}},
    {"name": "spread", "engine": "sim", "args": SIM, "max_parallel": 2,
     "autoscale": {"min": 0, "max": 2, "target_in_flight": 8}},
    {"name": "up", "engine": "sim", "args": SIM,
     "autoscale": {"min": 1, "max": 3, "target_in_flight": 4}},
    {"name": "edge", "engine": "sim", "args": SIM,
     "autoscale": {"min": 1, "max": 3, "target_in_flight": 4}},
    {"name": "wave", "engine": "sim", "args": SIM, "max_parallel": 3,
     "autoscale": {"min": 1, "max": 4, "target_in_flight": 4, "scale_down_after": "30s"}},
    {"name": "coldload", "engine": "sim", "args": SIM, "max_parallel": 3, "cold_timeout": "3s",
     "autoscale": {"min": 0, "max": 3, "target_in_flight": 4}},
    {"name": "warmload", "engine": "sim", "args": SIM, "max_parallel": 3, "cold_timeout": "3s",
     "autoscale": {"min": 3, "max": 3, "target_in_flight": 4}},
    {"name": "nap", "engine": "sim", "args": [*SIM, "--wake-delay", str(WAKE_S)],
     "autoscale": {"min": 0, "max": 1, "target_in_flight": 4, "scale_down_after": "2s",
                   "scale_to_zero_after": "3s"},
     "idle_action": "sleep"},
]  # fmt: skip


def wait(what: str, check: Callable[[], Any], timeout: float = 120) -> Any:
    return _wait(what, check, timeout, done=answered)


class Fleet(AdminFleet):
    """The fleet as the bench reads and drives it."""

    def __init__(self, running: RunningFleet) -> None:
        super().__init__(running)
        self.client = openai.OpenAI(
            base_url=running.router_url + "/v1",
            api_key=running.api_key,
            timeout=120,  # its client's default pool (100 connections) holds the 80 clients
            max_retries=0,
        )

    def count(self, model: str) -> int:
        scaling = self.admin.get("/v1/status").json()["scaling"]
        return int(next(s["replicas"] for s in scaling if s["model"] == model))

    def ask(self, model: str, tokens: int = 32) -> dict[str, Any]:
        """One streamed chat completion: when it began and got its first token (monotonic),
        the replica that answered, and its error ("" when none)."""
        began = time.monotonic()
        first: float | None = None
        replica, error = "", ""
        try:
            with self.client.chat.completions.with_streaming_response.create(
                model=model,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=tokens,
                stream=True,
            ) as raw:
                replica = raw.headers.get("x-modelfleet-replica", "")
                for chunk in raw.parse():
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.monotonic()
        except openai.OpenAIError as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        if first is None and not error:
            error = "no token"
        return {"began": began, "first": first, "end": time.monotonic(), "replica": replica,
                "error": error}  # fmt: skip


def burst(fleet: Fleet, model: str, count: int) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: fleet.ask(model), range(count)))


def cold_cycles(fleet: Fleet, cycles: int) -> dict[str, Any]:
    failed, firsts, starts = 0, [], []
    for _ in range(cycles):
        wait("cold at zero replicas", lambda: not fleet.replicas("cold"), 120)
        began = time.monotonic()
        done = burst(fleet, "cold", 50)
        failed += sum(1 for d in done if d["error"])
        tokens = [d["first"] for d in done if d["first"] is not None]
        if tokens:
            firsts.append(min(tokens) - began)
        shards = [s for r in fleet.replicas("cold") for s in r["shards"] if s["startup_s"]]
        starts += [s["startup_s"] for s in shards]
    first = statistics.median(firsts) if firsts else None
    start = statistics.median(starts) if starts else None
    return {
        "cold_cycles": cycles,
        "cold_start_failed": failed,
        "cold_first_token_s": None if first is None else round(first, 2),
        "cold_first_token_target_s": STARTUP_S + 1,
        # The engine's own start (its process, its imports, then the startup delay), and
        # what the fleet adds to it: the decision, placement, routing and the release.
        "cold_engine_start_s": None if start is None else round(start, 2),
        "cold_fleet_overhead_s": (
            round(first - start, 2) if first is not None and start is not None else None
        ),
    }


def release_spread(fleet: Fleet) -> dict[str, Any]:
    done = burst(fleet, "spread", 100)
    served = [d["replica"] for d in done if not d["error"]]
    counts = {r: served.count(r) for r in set(served)}
    return {
        "release_spread": round(max(counts.values()) / len(done), 2) if counts else None,
        "release_replicas": len(counts),
        "release_failed": sum(1 for d in done if d["error"]),
    }


def scale_up(fleet: Fleet) -> dict[str, Any]:
    return {
        "scale_up_decision_s": round(time_to_scale_up(fleet, "up", 12), 2),
        "scale_up_decision_over_s": round(time_to_scale_up(fleet, "edge", 5), 2),
        "scale_up_after_s": 2.0,
    }


def time_to_scale_up(fleet: Fleet, model: str, in_flight: int) -> float:
    """From `in_flight` requests kept going at `model`'s one replica to a second placed."""
    wait(f"{model} serving", lambda: any(r["state"] == "ready" for r in fleet.replicas(model)))
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            fleet.ask(model, tokens=400)  # ~4 s each

    pool = ThreadPoolExecutor(in_flight)
    began = time.monotonic()
    for _ in range(in_flight):
        pool.submit(keep_busy)
    placed = wait(f"a second replica of {model}", lambda: len(fleet.replicas(model)) >= 2, 60)
    took = time.monotonic() - began
    stop.set()
    pool.shutdown(wait=True)
    assert placed
    return took


class GpuSeconds:
    """Samples, every half second until stopped, the replicas in the table over all models."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.counts: list[tuple[float, int]] = []  # (when, replicas in the table)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            listed = self.fleet.admin.get("/v1/replicas").json()["replicas"]
            self.counts.append((time.monotonic(), len(listed)))
            time.sleep(0.5)

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join()
        pairs = itertools.pairwise(self.counts)
        used = sum(n * (t1 - t0) for (t0, n), (t1, _) in pairs)
        span = self.counts[-1][0] - self.counts[0][0] if len(self.counts) > 1 else 0.0
        fixed = sum(m["autoscale"]["max"] for m in MODELS) * span
        return {
            "gpu_seconds_used": round(used, 1),
            "gpu_seconds_fixed_max": round(fixed, 1),
            "gpu_seconds_saved": round(fixed - used, 1),
        }


def square_wave(fleet: Fleet, seconds: float, half_period: float = 20.0) -> dict[str, Any]:
    wait("wave serving", lambda: any(r["state"] == "ready" for r in fleet.replicas("wave")), 60)
    done: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one() -> None:
        result = fleet.ask("wave")
        with lock:
            done.append(result)

    began, began_wall = time.monotonic(), time.time()
    with ThreadPoolExecutor(128) as pool:
        while (now := time.monotonic()) - began < seconds:
            high = int((now - began) // half_period) % 2 == 0
            pool.submit(one)
            time.sleep(1 / (40.0 if high else 4.0))
    steps = sorted(
        (e["first_at"], e["message"])
        for e in fleet.events("ReplicasScaled")
        if e["regarding"] == "model/wave" and e["first_at"] >= began_wall
    )
    flaps = 0
    for i, (at, message) in enumerate(steps):
        if "down" in message.split(":")[1]:
            flaps += any(
                later - at <= 2 * half_period and "up" in m.split(":")[1]
                for later, m in steps[i + 1 :]
            )
    ttfts = [d["first"] - d["began"] for d in done if d["first"] is not None]
    within = sum(1 for t in ttfts if t <= 2.0)
    return {
        "square_wave_s": seconds,
        "square_wave_flaps": flaps,
        "square_wave_scale_changes": len(steps),
        "slo_attainment": round(within / len(done), 4) if done else None,
        "square_wave_requests": len(done),
        "square_wave_failed": sum(1 for d in done if d["error"]),
    }


def closed_loop(fleet: Fleet, model: str, clients: int, seconds: float) -> list[dict[str, Any]]:
    """`clients` clients that each ask again as soon as answered, until `seconds` after the
    model's first answer."""
    done: list[dict[str, Any]] = []
    first: list[float] = []
    lock = threading.Lock()

    def client() -> None:
        while not first or time.monotonic() < first[0] + seconds:
            result = fleet.ask(model)
            with lock:
                done.append(result)
                if not result["error"] and not first:
                    first.append(result["end"])
            if result["error"]:
                time.sleep(0.2)

    with ThreadPoolExecutor(clients) as pool:
        for running in [pool.submit(client) for _ in range(clients)]:
            running.result()
    for d in done:
        d["after_first"] = d["began"] >= first[0]
    return done


def cold_load(fleet: Fleet, seconds: float, clients: int = 80) -> dict[str, Any]:
    def rate(done: list[dict[str, Any]]) -> float:
        counted = [d for d in done if d["after_first"] and not d["error"]]
        span = max(d["end"] for d in counted) - min(d["began"] for d in counted)
        return float(len(counted) / span)

    def warm_serving() -> bool:
        return len([r for r in fleet.replicas("warmload") if r["state"] == "ready"]) == 3

    wait("coldload at zero replicas", lambda: not fleet.replicas("coldload"), 60)
    cold = closed_loop(fleet, "coldload", clients, seconds)
    wait("warmload's three replicas serving", warm_serving, 120)
    warm = closed_loop(fleet, "warmload", clients, seconds)
    failed = [d["error"] for d in cold if d["after_first"] and d["error"]]
    return {
        "cold_load_clients": clients,
        "cold_load_503": sum(1 for e in failed if "503" in e),
        "cold_load_failed": len(failed),
        "cold_load_requests": sum(1 for d in cold if d["after_first"]),
        "cold_vs_warm_throughput": round(rate(cold) / rate(warm), 3),
        "warm_load_failed": sum(1 for d in warm if d["error"]),
    }


def wake(fleet: Fleet) -> dict[str, Any]:
    first = fleet.ask("nap")  # cold: starts it
    assert not first["error"], first

    def asleep() -> bool:
        found = fleet.replicas("nap")
        return bool(found) and all(r["state"] == "sleeping" for r in found)

    wait("nap asleep", asleep, 60)
    wait(
        "nap's engine asleep",
        lambda: fleet.replicas("nap")[0]["shards"][0]["state"] == "sleeping",
        60,
    )
    done = fleet.ask("nap", tokens=1)
    return {
        "wake_s": round(done["end"] - done["began"], 2),
        "wake_target_s": WAKE_S + 0.5,
        "wake_failed": bool(done["error"]),
    }


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--wave-s", type=float, default=180.0)
    parser.add_argument("--load-s", type=float, default=20.0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-autoscale-"))
    state = folder / "fleet"
    state.mkdir(mode=0o700)
    # Each its own list: YAML writes a list met twice as an alias, which a catalog refuses.
    models = [{**m, "args": list(m["args"])} for m in MODELS]
    (state / "catalog.yaml").write_text(yaml.safe_dump({"models": models}))
    running = start_fleet(state, FleetOptions(gpus="8x80GB", report_interval=1.0))
    results: dict[str, Any] = {"startup_delay_s": STARTUP_S}
    try:
        fleet = Fleet(running)
        gpus = GpuSeconds(fleet)
        results.update(wake(fleet))
        results.update(scale_up(fleet))
        results.update(release_spread(fleet))
        results.update(cold_cycles(fleet, args.cycles))
        results.update(cold_load(fleet, args.load_s))
        results.update(square_wave(fleet, args.wave_s))
        results.update(gpus.finish())
    finally:
        running.fleet.stop()
    json_line(results)


if __name__ == "__main__":
    main()
