"""On a machine with NVIDIA GPUs: the fleet on its real GPUs, as `modelfleet up --gpus nvml`
runs it. Not part of the test suite (CI has no GPU); run it where there is one.

A control plane, a router and one agent reading the machine's GPUs through NVML, serving a
simulated engine on one GPU. It checks, and prints as one JSON line:

- `gpus`: what the agent reports of each GPU (model, memory, health), as `ctl nodes` shows;
- `metrics_gpu_lines`: the agent's `/metrics` lines for GPU memory and health;
- `served`: a request through the router to the replica placed on a real GPU, and the
  `CUDA_VISIBLE_DEVICES` its engine was started with;
- `held_gib_seen`: `--hold-gib` GiB taken on GPU 0 by another process (PyTorch), as the
  agent's metrics read it, and `held_seen_after_s`, how long until they did.

    python bench/gpu_check.py [--hold-gib 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from kit import end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.up import FleetOptions, start_fleet
from modelfleet.up.configs import REAL_GPUS

MODEL = {"name": "on-gpu", "engine": "sim", "gpus_per_shard": 1, "gpu_memory": "10GiB"}
HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]) * 2**30, dtype=torch.uint8, device="cuda:0")
print("held", flush=True)
time.sleep(120)
"""


def wait(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return _wait(what, check, timeout, every=0.1)


def gpu_used(metrics: str, gpu: str = "0") -> float:
    for line in metrics.splitlines():
        if line.startswith(f'modelfleet_agent_gpu_memory_used_bytes{{gpu="{gpu}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no memory line for GPU {gpu} in the agent's metrics")


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-gib", type=int, default=20)
    args = parser.parse_args()
    out: dict[str, Any] = {"bench": "gpu_check"}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        (state / "catalog.yaml").write_text(yaml.safe_dump({"models": [MODEL]}))
        options = FleetOptions(gpus=REAL_GPUS, nodes=("node-1",), report_interval=0.5)
        running = start_fleet(state, options)
        try:
            admin = httpx.Client(
                base_url=running.admin_url,
                headers={"authorization": f"Bearer {running.admin_token}"},
                timeout=20,
            )
            agent = httpx.Client(
                base_url=running.agent_admin["node-1"],
                headers={"authorization": f"Bearer {running.agent_token}"},
                timeout=20,
            )

            def ready() -> dict[str, Any] | None:
                reps = admin.get("/v1/replicas").json()["replicas"]
                return next((r for r in reps if r["state"] == "ready"), None)

            replica = wait("the replica ready on a real GPU", ready, 90)
            [node] = admin.get("/v1/nodes").json()["nodes"]
            out["gpus"] = [
                {k: g[k] for k in ("index", "model", "memory_total", "memory_free", "healthy")}
                for g in node["gpus"]
            ]
            metrics = agent.get("/metrics").text
            out["metrics_gpu_lines"] = [
                line
                for line in metrics.splitlines()
                if line.startswith(("modelfleet_agent_gpu_memory", "modelfleet_agent_gpu_healthy"))
            ]
            answer = httpx.post(
                f"{running.router_url}/v1/completions",
                headers={"authorization": f"Bearer {running.api_key}"},
                json={"model": "on-gpu", "prompt": "hello", "max_tokens": 4},
                timeout=30,
            )
            pid = replica["shards"][0]["pid"]
            env = psutil.Process(pid).environ()
            out["served"] = {
                "status": answer.status_code,
                "gpus": replica["shards"][0]["gpus"],
                "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES"),
            }
            before = gpu_used(agent.get("/metrics").text)
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLD, str(args.hold_gib)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert holder.stdout is not None
                line = holder.stdout.readline().strip()
                if line != "held":
                    raise RuntimeError(f"the holder of {args.hold_gib} GiB said {line!r}")
                held_at = time.monotonic()
                want = args.hold_gib * 2**30 * 0.95

                def seen() -> float | None:
                    grew = gpu_used(agent.get("/metrics").text) - before
                    return grew if grew >= want else None

                grew = wait("the agent's metrics to see the memory taken", seen, 30)
                out["held_gib_seen"] = round(grew / 2**30, 2)
                out["held_seen_after_s"] = round(time.monotonic() - held_at, 2)
            finally:
                holder.kill()
                holder.wait()
        finally:
            running.fleet.stop()
    json_line(out)


if __name__ == "__main__":
    main()
