"""Single services as real processes: router without a control plane, engine drain, agent stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.agent.service import Agent, AgentSettings
from modelfleet.agent.supervisor import SupervisorSettings
from modelfleet.processes import running as alive
from modelfleet.wire import NodeAssignment, ShardAssignment, ShardState

from .conftest import Procs, wait_json

KEY = "mf-test-key"


def start_engine(procs: Procs, tmp: Path, name: str, *extra: str) -> tuple[str, int]:
    ready = tmp / f"engine-{name}.json"
    proc = procs.start(
        "engine-sim", "--model", name, "--port", "0", "--ready-file", str(ready), *extra, log=name
    )
    return wait_json(ready, proc)["urls"]["engine"], proc.pid


def start_router(procs: Procs, tmp: Path, models: list[dict[str, object]]) -> str:
    config = tmp / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"port": 0, "push_port": 0, "api_keys": [{"name": "t", "key": KEY}], "models": models}
        )
    )
    ready = tmp / "router.json"
    proc = procs.start("router", "--config", str(config), "--ready-file", str(ready), log="router")
    return wait_json(ready, proc)["urls"]["router"]


def offline_agent(state_dir: Path, stop_grace: float) -> AgentSettings:
    """An agent's settings with no control plane to reach (9 is the discard port): tests drive
    it by calling apply() with assignments themselves."""
    return AgentSettings(
        control_plane="http://127.0.0.1:9",
        node="n",
        token=None,
        state_dir=state_dir,
        supervisor=SupervisorSettings(stop_grace=stop_grace),
    )


def chat(router: str, model: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }
    return httpx.post(
        f"{router}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=10,
    )


def test_router_with_a_static_config_and_no_control_plane(procs: Procs, tmp_path: Path) -> None:
    engine, _ = start_engine(procs, tmp_path, "static")
    dead = "http://127.0.0.1:9"  # nothing listens there: retried before the first byte
    router = start_router(
        procs,
        tmp_path,
        [{"name": "static", "endpoints": [dead, engine]}, {"name": "empty", "endpoints": []}],
    )
    for _ in range(6):
        r = chat(router, "static")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    streamed = chat(router, "static", stream=True)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert chat(router, "empty").status_code == 503
    assert chat(router, "missing").status_code == 404
    r = httpx.get(f"{router}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert sorted(m["id"] for m in r.json()["data"]) == ["empty", "static"]
    assert httpx.get(f"{router}/v1/models").status_code == 401


def test_engine_finishes_in_flight_requests_on_sigterm(procs: Procs, tmp_path: Path) -> None:
    engine, pid = start_engine(procs, tmp_path, "drain", "--itl", "0.05", "--ttft", "0.0")
    result: dict[str, object] = {}

    def stream() -> None:
        body = {"model": "drain", "prompt": "x", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", f"{engine}/v1/completions", json=body, timeout=20) as r:
            result["text"] = "".join(r.iter_text())

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.4)  # the request is mid-stream (30 tokens take 1.5 s)
    proc = procs.started[-1]
    proc.send_signal(signal.SIGTERM)
    thread.join(timeout=20)
    assert str(result["text"]).rstrip().endswith("data: [DONE]")
    assert str(result["text"]).count('"text": " ') == 30
    assert proc.wait(timeout=10) == 0 and not alive(pid)


def test_agent_starts_and_stops_assigned_shards(tmp_path: Path) -> None:
    """An unassigned shard is stopped: SIGTERM, then SIGKILL for an engine that ignores it."""

    def shard(rid: str, engine: str, command: str | None = None) -> ShardAssignment:
        return ShardAssignment(
            replica_id=rid,
            model="m",
            engine=engine,
            source="m",
            args=[],
            env={},
            command=command,
            rank=0,
            num_shards=1,
            gpus=[0],
            engine_digest="d",
            startup_timeout=30,
        )

    ignore_term = (
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    )
    stubborn = f'{sys.executable} -c "{ignore_term}"'

    async def go() -> None:
        settings = offline_agent(tmp_path, stop_grace=1.0)
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            agent.apply(
                NodeAssignment(
                    node="n", shards=[shard("sim", "sim"), shard("hard", "command", stubborn)]
                )
            )
            deadline = time.monotonic() + 20
            while agent.shards["sim/0"].state is not ShardState.READY:
                assert time.monotonic() < deadline, agent.shards["sim/0"].error
                await asyncio.sleep(0.05)
            pids = [s.proc.pid for s in agent.shards.values() if s.proc]
            assert len(pids) == 2 and all(alive(p) for p in pids)
            report = agent.report()
            assert {s.replica_id: s.state for s in report.shards}["sim"] is ShardState.READY

            agent.apply(NodeAssignment(node="n", shards=[]))
            assert not agent.shards and set(agent.stopping) == {"sim/0", "hard/0"}
            while agent.stopping:
                assert time.monotonic() < deadline + 10
                await asyncio.sleep(0.05)
            assert not any(alive(p) for p in pids)

    asyncio.run(go())


def test_control_plane_refuses_an_invalid_catalog_listing_every_problem(tmp_path: Path) -> None:
    import subprocess

    (tmp_path / "catalog.yaml").write_text(
        "models:\n  - name: a\n    engine: vlm\n  - name: b\n    engine: sim\n    replicas: 0\n"
    )
    (tmp_path / "cp.yaml").write_text(
        yaml.safe_dump({"catalog": "catalog.yaml", "admin_token": "x" * 16})
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelfleet",
            "control-plane",
            "--config",
            str(tmp_path / "cp.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "model a: engine: unknown engine 'vlm'" in done.stderr
    assert "model b: replicas: must be a positive integer, got 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_shard_of_rank_1_starts_once_it_knows_where_shard_0_is(tmp_path: Path) -> None:
    out = tmp_path / "leader.txt"
    write_leader = (
        f"{sys.executable} -c \"import sys,time; open(sys.argv[1],'w').write(sys.argv[2]); "
        f'time.sleep(60)" {out} {{leader}}'
    )

    def rank(r: int, leader: str | None) -> ShardAssignment:
        return ShardAssignment(
            replica_id="tp",
            model="m",
            engine="command",
            source="m",
            args=[],
            env={},
            command=write_leader,
            rank=r,
            num_shards=2,
            gpus=[0],
            engine_digest="d",
            startup_timeout=30,
            leader=leader,
        )

    async def go() -> None:
        settings = offline_agent(tmp_path, stop_grace=1.0)
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            agent.apply(NodeAssignment(node="n", shards=[rank(1, None)]))
            assert agent.shards == {}  # waits for shard 0's address
            agent.apply(NodeAssignment(node="n", shards=[rank(1, "10.0.0.7:29500")]))
            deadline = time.monotonic() + 20
            while not out.exists() or not out.read_text():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert out.read_text() == "10.0.0.7:29500"
            agent.apply(NodeAssignment(node="n", shards=[]))
            while agent.stopping:
                await asyncio.sleep(0.05)

    asyncio.run(go())


def test_a_new_agent_adopts_live_engines_and_stops_the_unassigned(tmp_path: Path) -> None:
    """Engines outlive their agent; the next agent takes over the ones still running (same pid,
    no restart), forgets the dead ones, and stops what it is no longer assigned."""

    def sim(rid: str) -> ShardAssignment:
        return ShardAssignment(
            replica_id=rid, model="m", engine="sim", source="m", args=[], env={}, rank=0,
            num_shards=1, gpus=[0], engine_digest="d", startup_timeout=30,
        )  # fmt: skip

    settings = offline_agent(tmp_path, stop_grace=2.0)

    async def until_ready(agent: Agent, keys: list[str]) -> None:
        deadline = time.monotonic() + 20
        while any(agent.shards[k].state is not ShardState.READY for k in keys):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def first_run() -> dict[str, int]:
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            agent.apply(NodeAssignment(node="n", shards=[sim("keep"), sim("drop"), sim("dead")]))
            await until_ready(agent, ["keep/0", "drop/0", "dead/0"])
            pids = {k: s.proc.pid for k, s in agent.shards.items() if s.proc}
        # Leaving the block ends the agent as a crash would: its engines are left running.
        return pids

    pids = asyncio.run(first_run())
    assert all(alive(p) for p in pids.values())
    os.killpg(pids["dead/0"], signal.SIGKILL)  # one engine dies while no agent runs
    deadline = time.monotonic() + 10
    while alive(pids["dead/0"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    async def second_run() -> None:
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            assert sorted(agent.adopt()) == ["drop/0", "keep/0"]
            await until_ready(agent, ["keep/0", "drop/0"])
            assert {k: s.proc.pid for k, s in agent.shards.items() if s.proc} == {
                "keep/0": pids["keep/0"],
                "drop/0": pids["drop/0"],
            }
            agent.apply(NodeAssignment(node="n", shards=[sim("keep")]))
            while agent.stopping:
                await asyncio.sleep(0.05)
            assert not alive(pids["drop/0"]) and alive(pids["keep/0"])
            assert agent.shards["keep/0"].proc.pid == pids["keep/0"]  # type: ignore[union-attr]
            agent.apply(NodeAssignment(node="n", shards=[]))
            while agent.stopping:
                await asyncio.sleep(0.05)

    try:
        asyncio.run(second_run())
    finally:
        for pid in pids.values():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
    assert not alive(pids["keep/0"])
