"""How long a catalog change takes to reach the router, and what a steady client sees meanwhile.

Starts a fleet the way `modelfleet up` does (router, control plane, two agents, simulated
engines) in a temporary folder, keeps a steady client on model `a`, and makes `--changes`
catalog changes by writing the watched file, then as many through the admin API (what
`ctl catalog apply` calls). Each change adds or removes model `b`. For each it measures the time
from the write (or the call) to the router holding the new catalog version, read from the
router's own push API. It prints the median and max of each, the client's request rate and
failures before, during and after the changes, and ends with one JSON line of those figures.

    python bench/catalog_swap.py [--changes 20]

Target: at most 1 s from file to router; zero failed requests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from kit import end_on_sigterm, json_line, wait

from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import FleetOptions, RunningFleet, start_fleet

A = {"name": "a", "engine": "sim", "args": ["--ttft", "0.02", "--itl", "0.005"]}
B = {"name": "b", "engine": "sim"}


def catalog(with_b: bool) -> str:
    return yaml.safe_dump({"models": [A, B] if with_b else [A]})


def router_catalog_version(push: httpx.Client) -> int:
    return int(push.get("/v1/routing").json()["catalog_version"])


def wait_router(push: httpx.Client, version: int, began: float, timeout: float = 10) -> float:
    """Seconds from `began` until the router holds catalog `version`."""
    left = timeout - (time.monotonic() - began)
    wait(
        f"the router to hold catalog version {version}",
        lambda: router_catalog_version(push) >= version,
        left,
        every=0.005,
    )
    return time.monotonic() - began


def run(changes: int, gap: float, window: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        (state / "catalog.yaml").write_text(catalog(False))
        fleet = start_fleet(state, FleetOptions(report_interval=0.5))
        try:
            return measure(fleet, changes, gap, window)
        finally:
            fleet.fleet.stop()


def measure(fleet: RunningFleet, changes: int, gap: float, window: float) -> dict[str, Any]:
    auth = {"authorization": f"Bearer {fleet.admin_token}"}
    push = httpx.Client(base_url=fleet.push_url, headers=auth, timeout=10)
    admin = httpx.Client(base_url=fleet.admin_url, headers=auth, timeout=10)
    probe = {"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    client_auth = {"authorization": f"Bearer {fleet.api_key}"}
    deadline = time.monotonic() + 30
    while (
        httpx.post(
            f"{fleet.router_url}/v1/chat/completions", json=probe, headers=client_auth
        ).status_code
        != 200
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("model a did not serve within 30 s")
        time.sleep(0.1)

    client = SteadyClient(fleet.router_url, fleet.api_key, "a")
    client.start()
    time.sleep(window)
    changes_began = time.monotonic()
    version = int(admin.get("/v1/catalog").json()["version"])
    by_file: list[float] = []
    by_api: list[float] = []
    for i in range(changes):
        text = catalog(with_b=i % 2 == 0)
        tmp = fleet.catalog_file.with_suffix(".tmp")
        tmp.write_text(text)
        began = time.monotonic()
        os.replace(tmp, fleet.catalog_file)
        version += 1
        by_file.append(wait_router(push, version, began))
        time.sleep(gap)
    for i in range(changes):
        text = catalog(with_b=i % 2 == 0)
        began = time.monotonic()
        answer = admin.put("/v1/catalog", content=text)
        answer.raise_for_status()
        version += 1
        by_api.append(wait_router(push, version, began))
        time.sleep(gap)
    changes_ended = time.monotonic()
    time.sleep(window)
    client.stop()

    before = client.window(changes_began - window, changes_began)
    during = client.window(changes_began, changes_ended)
    after = client.window(changes_ended, changes_ended + window)
    return {
        "changes": changes,
        "file_to_router_s": {"median": statistics.median(by_file), "max": max(by_file)},
        "api_to_router_s": {"median": statistics.median(by_api), "max": max(by_api)},
        "requests_per_s": {"before": before[0], "during": during[0], "after": after[0]},
        "during_over_before": during[0] / max(before[0], 1e-9),
        "failed_requests": {"before": before[1], "during": during[1], "after": after[1]},
        "failures": client.failures[:10],
    }


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=20, help="changes by file, and by API")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between changes")
    parser.add_argument("--window", type=float, default=3.0, help="seconds before and after")
    args = parser.parse_args()
    result = run(args.changes, args.gap, args.window)

    def row(name: str, figures: dict[str, float]) -> None:
        print(f"  {name:<26} median {figures['median']:.3f} s   max {figures['max']:.3f} s")

    print(f"catalog change to router, {args.changes} changes each way (target: <= 1 s):")
    row("file written -> router", result["file_to_router_s"])
    row("API call -> router", result["api_to_router_s"])
    print("steady client on model a (requests/s, failed requests):")
    for phase in ("before", "during", "after"):
        rate, failed = result["requests_per_s"][phase], result["failed_requests"][phase]
        print(f"  {phase:<8} {rate:7.1f}/s   {failed} failed")
    print(f"  during / before: {result['during_over_before']:.2f}")
    for failure in result["failures"]:
        print(f"  failure: {failure}")
    figures = {k: v for k, v in result.items() if k != "failures"}
    rounded = json.loads(json.dumps(figures), parse_float=lambda x: round(float(x), 4))
    json_line({"bench": "catalog_swap", **rounded})


if __name__ == "__main__":
    main()
