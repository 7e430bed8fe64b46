"""vLLM's CPU build behind the whole fleet: a tiny random Llama with LoRA adapters, made offline
by tests/vllm/venv.sh (which the README's test command runs) in a venv of vLLM's own.

What the model writes is noise; what is asserted is what the fleet does with a real vLLM: it
starts it from the node's `--engine-program`, routes plain and streamed answers to it,
republishes its metrics, loads, swaps and fails its adapters with vLLM's own words, ends
every process of an engine that crashed before starting it again, and stops one only once
the streams in flight have finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.agent.gpus import CpuSlots, SimulatedGpus
from modelfleet.agent.service import Agent
from modelfleet.engines.base import core_list
from modelfleet.host.processes import group_members
from modelfleet.http.loadgen import SteadyClient
from modelfleet.messages.wire import NodeAssignment, ShardAssignment, ShardState
from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, until, wait_for, wait_requests
from .test_processes import offline_agent
from .vllm_kit import ARGS, START_S, TINY

# Its own waits (START_S for a start) say what they waited for: pytest's cut-off is later.
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(3 * START_S)]


def tiny(**more: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "engine": "vllm",
        "source": str(TINY / "model"),
        "args": list(ARGS),  # a list of its own: YAML writes a shared one as an alias
        "startup_timeout": START_S,
        "max_loras": 3,
        "max_lora_rank": 8,
        "adapters": [
            {"name": "a1", "source": str(TINY / "adapters" / "a1")},
            {"name": "a2", "source": str(TINY / "adapters" / "a2")},
            {"name": "broken", "source": str(TINY / "adapters" / "missing")},
        ],
        **more,
    }


# The same tiny model, with no replica until a request asks for it, and none soon after.
COLD = {
    "name": "cold", "engine": "vllm", "source": str(TINY / "model"), "args": list(ARGS),
    "startup_timeout": START_S, "cold_timeout": START_S,
    "autoscale": {"min": 0, "max": 1, "target_in_flight": 4, "scale_to_zero_after": 5},
}  # fmt: skip


@pytest.fixture(scope="module")
def fleet(vllm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    # vLLM is not on the agent's PATH: the node names its program. The node offers its cores,
    # one slot each: two vLLMs on the same cores starve each other's start (a replacement
    # took over 300 s beside a loaded one on 2 cores); a roll needs two slots.
    if len(CpuSlots("1").slots) < 2:
        pytest.fail("the real_vllm fleet needs 2 cores: one per vLLM during a roll")
    agent_args = ("--engine-program", f"vllm={vllm}", "--backoff-base", "1")
    models = [tiny(), COLD]
    with fleet_of(tmp, models, nodes=("node-1",), gpus="cpu:1", agent_args=agent_args) as running:
        yield running


def chat(model: str, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        **more,
    }


def served(op: Operator, model: str) -> httpx.Response:
    return op.client.post("/v1/chat/completions", json=chat(model), timeout=60)


def stream_of(client: httpx.Client, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion, in order; fails unless it ends with [DONE]."""
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", url, json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[len("data: ") :]))
    raise AssertionError(f"the stream ended without [DONE] after {len(chunks)} chunk(s)")


def test_vllm_serves_plain_and_streamed_answers_and_its_metrics_through_the_fleet(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    op = Operator(fleet, tmp_path)
    wait_for("tiny to serve through the router", lambda: served(op, "tiny").status_code == 200,
             timeout=START_S)  # fmt: skip
    [replica] = op.replicas("tiny")
    assert replica["state"] == "ready"
    plain = served(op, "tiny").json()
    assert plain["model"] == "tiny" and plain["usage"]["completion_tokens"] == 8
    assert plain["system_fingerprint"].startswith("vllm-0.32")  # vLLM's answer, not ours

    chunks = stream_of(op.client, "/v1/chat/completions", chat("tiny", ignore_eos=True))
    text = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for t in text if t) >= 2  # streamed, token by token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    page = httpx.get(
        fleet.agent_admin["node-1"] + "/metrics",
        headers={"authorization": f"Bearer {fleet.agent_token}"},
        timeout=10,
    ).text
    ours = {
        s.name: s.labels
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name.startswith("modelfleet_engine_")
    }
    for name in (
        "modelfleet_engine_requests_running",
        "modelfleet_engine_requests_waiting",
        "modelfleet_engine_kv_cache_usage_ratio",
        "modelfleet_engine_time_to_first_token_seconds_count",
        "modelfleet_engine_inter_token_latency_seconds_count",
    ):
        assert name in ours, f"{name} not republished from vLLM's metrics: {sorted(ours)}"
        assert ours[name]["model"] == "tiny" and ours[name]["replica"] == replica["id"]


def _adapters(op: Operator) -> dict[str, dict[str, Any]]:
    [replica] = op.replicas("tiny")
    return {a["name"]: a for a in replica["shards"][0]["adapters"]}


def test_vllm_loads_swaps_and_fails_catalog_adapters_with_its_own_words(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    op = Operator(fleet, tmp_path)
    wait_for("a1 and a2 served", lambda: served(op, "a1").status_code == 200
             and served(op, "a2").status_code == 200, timeout=START_S)  # fmt: skip
    assert served(op, "a1").json()["model"] == "a1"
    failed = wait_for(
        "broken reported failed",
        lambda: (a := _adapters(op).get("broken")) and a["state"] == "failed" and a,
        timeout=60,
    )
    assert "No adapter found" in failed["error"]  # vLLM's own words
    [replica] = op.replicas("tiny")
    pid = replica["shards"][0]["pid"]

    # A swap: a2 goes, a3 (a2's weights under another name) comes; the engine stays.
    swapped = tiny()
    swapped["adapters"] = [
        swapped["adapters"][0],
        {"name": "a3", "source": str(TINY / "adapters" / "a2")},
    ]
    op.apply(swapped)
    wait_for("a3 served", lambda: served(op, "a3").status_code == 200, timeout=60)
    wait_for("a2 unloaded", lambda: "a2" not in _adapters(op), timeout=60)
    assert served(op, "a2").status_code == 404
    [after] = op.replicas("tiny")
    assert after["shards"][0]["pid"] == pid and after["id"] == replica["id"]
    op.apply(tiny())  # as it was, for the tests after this one
    wait_for("a2 served again", lambda: served(op, "a2").status_code == 200, timeout=60)


def _tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(p) for p in group_members(pid)]


def test_a_crashed_vllm_leaves_no_process_behind_and_serves_again(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    """kill -9 of vLLM's API server alone, as a crash would: its EngineCore and worker would
    stay, holding the cores (or GPUs) the next start needs; the agent ends them first."""
    op = Operator(fleet, tmp_path)
    wait_for("tiny served", lambda: served(op, "tiny").status_code == 200, timeout=START_S)
    [replica] = op.replicas("tiny")
    shard = replica["shards"][0]
    server = shard["pid"]
    tree = _tree(server)
    names = {p.name() for p in tree}
    assert len(tree) >= 3, names  # the API server, its EngineCore, a worker
    os.kill(server, signal.SIGKILL)
    wait_for(
        "tiny started again and serving",
        lambda: (r := op.replicas("tiny")) and r[0]["shards"][0]["restarts"] > shard["restarts"]
        and served(op, "tiny").status_code == 200,
        timeout=START_S,
    )  # fmt: skip
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left running after the crash: {[(p.pid, p.name()) for p in left]}"
    [again] = op.replicas("tiny")
    assert again["id"] == replica["id"] and again["shards"][0]["pid"] != server


def test_an_args_change_rolls_vllm_with_nothing_failed(fleet: RunningFleet, tmp_path: Path) -> None:
    """A changed `args` starts a new vLLM beside the old (on a slot of its own), moves the
    traffic, then stops the old one: a client sending all along sees no failure."""
    op = Operator(fleet, tmp_path)
    wait_for("tiny serving", lambda: served(op, "tiny").status_code == 200, timeout=START_S)
    [before] = op.replicas("tiny")
    client = SteadyClient(
        fleet.router_url, fleet.api_key, "tiny", workers=2, max_tokens=4, extra={"ignore_eos": True}
    )
    client.start()
    try:
        wait_requests(client, 5, " before the change")
        op.apply(tiny(args=[*ARGS, "--max-num-seqs", "16"]), COLD)
        wait_for(
            "the new vLLM alone serving tiny",
            lambda: (
                [(r["id"] != before["id"], r["state"]) for r in op.replicas("tiny")]
                == [(True, "ready")]
            ),
            timeout=START_S,
        )
        wait_requests(client, 5, " after the change")
    finally:
        client.stop()
    failed = [o.error for o in client.outcomes if o.error]
    assert not failed, f"{len(failed)} of {len(client.outcomes)} failed: {failed[:3]}"
    [after] = op.replicas("tiny")
    server = psutil.Process(after["shards"][0]["pid"])
    assert "--max-num-seqs" in server.cmdline()
    # Beside the old one, on cores of its own: every process of it, its threads bound there.
    [old_slot], [slot] = before["shards"][0]["gpus"], after["shards"][0]["gpus"]
    assert slot != old_slot
    cores = list(CpuSlots("1").slots[slot])
    tree = _tree(server.pid)
    assert len(tree) >= 2  # the API server and its EngineCore at least
    assert {p.pid: p.cpu_affinity() for p in tree} == {p.pid: cores for p in tree}
    assert server.environ().get("VLLM_CPU_OMP_THREADS_BIND") == core_list(cores)


def test_vllm_scales_from_zero_for_a_request_and_back_to_zero(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    """A request for a model with no replica is held while its vLLM starts, then answered;
    idle, the model goes back to no replica and its engine is stopped."""
    op = Operator(fleet, tmp_path)
    assert op.replicas("cold") == []
    answer = op.client.post("/v1/chat/completions", json=chat("cold"), timeout=START_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["system_fingerprint"].startswith("vllm-")
    [replica] = op.replicas("cold")
    server = replica["shards"][0]["pid"]
    wait_for("cold back to no replica", lambda: op.replicas("cold") == [], timeout=120)
    wait_for("its vLLM stopped", lambda: not psutil.pid_exists(server)
             or psutil.Process(server).status() == psutil.STATUS_ZOMBIE, timeout=60)  # fmt: skip


def test_a_stopped_vllm_finishes_the_streams_in_flight(vllm: Path, tmp_path: Path) -> None:
    """SIGTERM with streams running: vLLM started with --shutdown-timeout finishes them (its
    default aborts them), and the stop returns once every process of it is gone."""
    assignment = ShardAssignment(
        replica_id="drain", model="tiny", engine="vllm", source=str(TINY / "model"),
        args=[*ARGS, "--max-model-len", "2048"], env={}, rank=0, num_shards=1, gpus=[0],
        engine_digest="d",
        startup_timeout=START_S,
    )  # fmt: skip
    settings = offline_agent(tmp_path, stop_grace=60.0, programs={"vllm": str(vllm)})
    streams = 8

    async def go() -> list[list[dict[str, Any]] | BaseException]:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            agent.apply(NodeAssignment(node="n", shards=[assignment]))
            try:
                shard = agent.shards["drain/0"]
                await until("vLLM ready", lambda: shard.state is ShardState.READY, timeout=START_S)
                assert shard.proc is not None
                tree = _tree(shard.proc.pid)
                headers = {"authorization": f"Bearer {shard.engine_key}"}
                with httpx.Client(base_url=shard.local_url, headers=headers) as client:
                    # The first request pays for vLLM's warm-up; a stream held back by it would
                    # start after the others had ended.
                    warm = client.post("/v1/chat/completions", json=chat("tiny"), timeout=120)
                    assert warm.status_code == 200, warm.text
                body = chat("tiny", max_tokens=2000, ignore_eos=True, stream=True)
                firsts, done = 0, 0

                def run() -> list[dict[str, Any]]:
                    nonlocal firsts, done
                    chunks: list[dict[str, Any]] = []
                    with (
                        httpx.Client(base_url=shard.local_url, headers=headers) as client,
                        client.stream(
                            "POST", "/v1/chat/completions", json=body, timeout=120
                        ) as answer,
                    ):
                        for line in answer.iter_lines():
                            if line == "data: [DONE]":
                                chunks.append({"done": True})
                            elif line.startswith("data: "):
                                if not chunks:
                                    firsts += 1
                                chunks.append(json.loads(line[len("data: ") :]))
                    done += 1
                    return chunks

                loop = asyncio.get_running_loop()
                threads = ThreadPoolExecutor(streams)  # asyncio's own runs 6 at a time on 2 cores
                running = [loop.run_in_executor(threads, run) for _ in range(streams)]
                await until("every stream under way", lambda: firsts == streams, timeout=60)
                in_flight = streams - done
                assert in_flight >= streams // 2, f"only {in_flight} streams running at the stop"
                agent.apply(NodeAssignment(node="n", shards=[]))
                await until("the engine stopped", lambda: not agent.stopping, timeout=90)
                assert not [p for p in tree if p.is_running() and p.status() != "zombie"]
                try:
                    return await asyncio.gather(*running, return_exceptions=True)
                finally:
                    threads.shutdown()
            finally:  # engines outlive their agent: a failure here must not leave vLLM running
                agent.apply(NodeAssignment(node="n", shards=[]))
                await until("the engine stopped", lambda: not agent.stopping, timeout=90)

    results = asyncio.run(go())
    ends = []
    for chunks in results:
        assert not isinstance(chunks, BaseException), chunks
        reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        ends.append(
            (len(chunks), [r for r in reasons if r], bool(chunks and chunks[-1].get("done")))
        )
    finished = [e for e in ends if e[1] == ["length"] and e[2]]
    assert len(finished) == streams, f"{len(finished)} of {streams} finished on stop: {ends}"
