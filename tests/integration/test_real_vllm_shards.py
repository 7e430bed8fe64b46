"""A replica of two shards on real vLLM: pipeline parallel across two agents' nodes (rank 1
headless), served through the router, and started again as one when rank 1's engine dies."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, wait_for
from .vllm_kit import ARGS, START_S, TINY

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(4 * START_S)]

WIDE = {
    "name": "wide", "engine": "vllm", "source": str(TINY / "model"), "args": ARGS,
    "shards": 2, "startup_timeout": START_S,
}  # fmt: skip


@pytest.fixture
def fleet(vllm: Path, tmp_path: Path) -> Iterator[RunningFleet]:
    agent_args = ("--engine-program", f"vllm={vllm}", "--backoff-base", "1")
    with fleet_of(tmp_path, [WIDE], nodes=("node-1", "node-2"), agent_args=agent_args) as running:
        yield running


def test_a_two_node_vllm_replica_serves_and_restarts_as_one(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    op = Operator(fleet, tmp_path)

    def serving() -> dict[str, Any] | None:
        found = [r for r in op.replicas("wide") if r["state"] == "ready"]
        if not found:
            return None
        body = {"model": "wide", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        try:  # the first answer of a new vLLM pays for its warm-up
            answer = op.client.post("/v1/chat/completions", json=body, timeout=120)
        except httpx.TimeoutException:
            return None
        return found[0] if answer.status_code == 200 else None

    before = wait_for("the two-shard vLLM serving through the router", serving, timeout=START_S)
    assert {s["node"] for s in before["shards"]} == {"node-1", "node-2"}
    pids = [s["pid"] for s in before["shards"]]
    headless = psutil.Process(pids[1]).cmdline()
    assert "--headless" in headless and "--pipeline-parallel-size" in headless
    os.kill(pids[1], signal.SIGKILL)
    after = wait_for(
        "both shards started anew and serving",
        lambda: (r := serving()) and all(s["pid"] not in pids for s in r["shards"]) and r,
        timeout=2 * START_S,
    )
    assert after["id"] == before["id"] and after["generation"] >= 1
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == "zombie"
