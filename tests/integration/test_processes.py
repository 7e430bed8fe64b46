"""Single services as real processes: router without a control plane, engine drain, agent stop."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.agent.records import EngineRecord, write_records
from modelfleet.agent.service import Agent
from modelfleet.agent.settings import AgentSettings, SupervisorSettings
from modelfleet.agent.supervisor import Shard
from modelfleet.engines import Launch, driver_for
from modelfleet.host.network import interface_of
from modelfleet.host.processes import ProcessId, stop_groups
from modelfleet.host.processes import running as alive
from modelfleet.messages.wire import AgentReport, NodeAssignment, ShardAssignment, ShardState

from .conftest import Procs, until, wait_for, wait_json

KEY = "mf-test-key"
PUSH_TOKEN = "push-token-0123456789"


def start_engine(procs: Procs, tmp: Path, name: str, *extra: str) -> tuple[str, int]:
    ready = tmp / f"engine-{name}.json"
    proc = procs.start(
        "engine-sim", "--model", name, "--port", "0", "--ready-file", str(ready), *extra, log=name
    )
    return wait_json(ready, proc)["urls"]["engine"], proc.pid


def start_router(
    procs: Procs, tmp: Path, models: list[dict[str, object]], **options: object
) -> str:
    """A router process with the client key `KEY`, routing `models`; `options`: more of its
    config (`push_token=PUSH_TOKEN` for its push API and metrics: `router_metrics`)."""
    config = tmp / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "port": 0,
                "push_port": 0,
                "api_keys": [{"name": "t", "key": KEY}],
                "models": models,
                **options,
            }
        )
    )
    config.chmod(0o600)
    ready = tmp / "router.json"
    proc = procs.start("router", "--config", str(config), "--ready-file", str(ready), log="router")
    return wait_json(ready, proc)["urls"]["router"]


def router_metrics(tmp: Path) -> str:
    """The metrics of the router `start_router(procs, tmp, ...)` started, from its push API."""
    push = json.loads((tmp / "router.json").read_text())["urls"]["push"]
    auth = {"authorization": f"Bearer {PUSH_TOKEN}"}
    return httpx.get(f"{push}/metrics", headers=auth, timeout=10).text


def offline_agent(state_dir: Path, stop_grace: float, **supervisor: Any) -> AgentSettings:
    """An agent's settings with no control plane to reach (9 is the discard port): tests drive
    it by calling apply() with assignments themselves."""
    return AgentSettings(
        control_plane="http://127.0.0.1:9",
        node="n",
        token=None,
        state_dir=state_dir,
        supervisor=SupervisorSettings(stop_grace=stop_grace, **supervisor),
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
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": "drain", "prompt": "x", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", f"{engine}/v1/completions", json=body, timeout=20) as r:
            chunks = []
            for chunk in r.iter_text():
                chunks.append(chunk)
                streaming.set()
            result["text"] = "".join(chunks)

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(timeout=20), "the stream's first chunk did not come within 20 s"
    proc = procs.started[-1]
    proc.send_signal(signal.SIGTERM)
    thread.join(timeout=20)
    assert not thread.is_alive(), "the stream did not end within 20 s of the SIGTERM"
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
            await until(
                "the sim shard ready", lambda: agent.shards["sim/0"].state is ShardState.READY
            )
            pids = [s.proc.pid for s in agent.shards.values() if s.proc]
            assert len(pids) == 2 and all(alive(p) for p in pids)
            report = agent.report()
            assert {s.replica_id: s.state for s in report.shards}["sim"] is ShardState.READY

            agent.apply(NodeAssignment(node="n", shards=[]))
            assert not agent.shards and set(agent.stopping) == {"sim/0", "hard/0"}
            await until("both shards stopped", lambda: not agent.stopping)
            assert not any(alive(p) for p in pids)

    asyncio.run(go())


def control_plane_run(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`modelfleet control-plane --config CONFIG FLAGS` to its exit (or 30 s)."""
    return subprocess.run(
        [sys.executable, "-m", "modelfleet", "control-plane", "--config", str(config), *flags],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_control_plane_refuses_an_invalid_catalog_listing_every_problem(tmp_path: Path) -> None:
    (tmp_path / "catalog.yaml").write_text(
        "models:\n  - name: a\n    engine: vlm\n  - name: b\n    engine: sim\n    replicas: 0\n"
    )
    config = {"catalog": "catalog.yaml", "admin_token": "x" * 16, "agent_token": "y" * 16}
    (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
    done = control_plane_run(tmp_path / "cp.yaml")
    assert done.returncode == 2
    assert "model a: engine: unknown engine 'vlm'" in done.stderr
    assert "model b: replicas: must be a positive integer, got 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_control_plane_without_an_agent_token_takes_reports_only_with_a_credential(
    procs: Procs, tmp_path: Path
) -> None:
    """Without a shared agent token, only nodes that joined (with a credential of their own)
    may report: a report with no credential is refused, unless the API is left open on
    purpose with --insecure-agent-api."""
    (tmp_path / "cp.yaml").write_text(
        yaml.safe_dump({"admin_token": "x" * 16, "agent_port": 0, "admin_port": 0})
    )
    body = AgentReport(node="n", boot_id="b", seq=1, address="127.0.0.1", gpus=[], shards=[])
    for extra, status in (((), 401), (("--insecure-agent-api",), 200)):
        ready = tmp_path / f"cp{len(extra)}.json"
        started = procs.start(
            "control-plane", "--config", str(tmp_path / "cp.yaml"), *extra,
            "--ready-file", str(ready), log=f"cp{len(extra)}",
        )  # fmt: skip
        agent_url = wait_json(ready, started)["urls"]["agent"]
        sent = httpx.post(f"{agent_url}/v1/report", content=body.model_dump_json(), timeout=10)
        assert sent.status_code == status, sent.text
        stop_groups([started.pid], grace=20)  # both use the same state dir
        started.wait()


LOOPBACK = interface_of("127.0.0.1")  # "lo" on Linux


def test_a_shard_of_rank_1_starts_once_it_knows_where_shard_0_is(tmp_path: Path) -> None:
    """...and with the interface that holds the agent's address for NCCL and Gloo (left to
    themselves they pick one, often the wrong one on a host with several)."""
    out = tmp_path / "leader.txt"
    write_leader = (
        f"{sys.executable} -c \"import os,sys,time; open(sys.argv[1],'w').write(' '.join(["
        "sys.argv[2], os.environ['NCCL_SOCKET_IFNAME'], os.environ['GLOO_SOCKET_IFNAME']])); "
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
            await until("rank 1 started", lambda: out.exists() and out.read_text())
            assert out.read_text() == f"10.0.0.7:29500 {LOOPBACK} {LOOPBACK}"
            agent.apply(NodeAssignment(node="n", shards=[]))
            await until("the unassigned shards stopped", lambda: not agent.stopping)

    asyncio.run(go())


STARTUP_TIMEOUT = 2.0


def test_a_new_agent_adopts_live_engines_and_stops_the_unassigned(tmp_path: Path) -> None:
    """Engines outlive their agent; the next agent takes over the ones still running (same pid,
    no restart), forgets the dead ones, and stops what it is no longer assigned. An adopted
    engine that answers is ready in the new agent's first report, and one older than its
    startup timeout is not killed for it: it was ready once, the timeout no longer applies."""

    def sim(rid: str) -> ShardAssignment:
        return ShardAssignment(
            replica_id=rid, model="m", engine="sim", source="m", args=[], env={}, rank=0,
            num_shards=1, gpus=[0], engine_digest="d", startup_timeout=STARTUP_TIMEOUT,
        )  # fmt: skip

    settings = offline_agent(tmp_path, stop_grace=2.0, liveness_interval=0.1)

    async def until_ready(agent: Agent, keys: list[str]) -> None:
        await until(
            f"shards {keys} ready",
            lambda: all(agent.shards[k].state is ShardState.READY for k in keys),
        )

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
    wait_for("the killed engine gone", lambda: not alive(pids["dead/0"]))
    keep = ProcessId.of(pids["keep/0"])
    assert keep is not None
    wait_for(
        "the engines older than their startup timeout",
        lambda: time.time() - keep.started > STARTUP_TIMEOUT + 0.5,
    )

    async def second_run() -> None:
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            assert sorted(await agent.adopt()) == ["drop/0", "keep/0"]
            first = {s.replica_id: s.state for s in agent.report().shards}
            assert first == {"keep": ShardState.READY, "drop": ShardState.READY}
            shard = agent.shards["keep/0"]
            probed = shard.probes
            await until("five liveness probes answered", lambda: shard.probes >= probed + 5)
            assert shard.state is ShardState.READY and shard.restarts == 0
            assert {k: s.proc.pid for k, s in agent.shards.items() if s.proc} == {
                "keep/0": pids["keep/0"],
                "drop/0": pids["drop/0"],
            }
            agent.apply(NodeAssignment(node="n", shards=[sim("keep")]))
            await until("the unassigned shards stopped", lambda: not agent.stopping)
            assert not alive(pids["drop/0"]) and alive(pids["keep/0"])
            assert agent.shards["keep/0"].proc.pid == pids["keep/0"]  # type: ignore[union-attr]
            agent.apply(NodeAssignment(node="n", shards=[]))
            await until("the unassigned shards stopped", lambda: not agent.stopping)

    try:
        asyncio.run(second_run())
    finally:
        stop_groups([p for p in pids.values() if alive(p)], grace=5)
    assert not alive(pids["keep/0"])


def test_adoption_refuses_a_pid_that_now_names_another_process(tmp_path: Path) -> None:
    """A recorded engine's pid, reused by another process since, is not adopted: the start
    time in the record does not match. The same record with the right start time is."""
    impostor = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        identity = ProcessId.of(impostor.pid)
        assert identity is not None
        assignment = ShardAssignment(
            replica_id="old", model="m", engine="sim", source="m", args=[], env={}, rank=0,
            num_shards=1, gpus=[0], engine_digest="d", startup_timeout=30,
        )  # fmt: skip

        def record(started: float) -> None:
            engine = EngineRecord(
                assignment=assignment, pid=impostor.pid, process_started=started, port=9
            )
            write_records(tmp_path, {assignment.key: engine})

        async def adopted() -> list[str]:
            settings = offline_agent(tmp_path, stop_grace=1.0)
            async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
                return await agent.adopt()

        record(identity.started - 50)  # the engine that had this pid started earlier
        assert asyncio.run(adopted()) == []
        assert alive(impostor.pid)  # not adopted, and not touched either
        record(identity.started)
        assert asyncio.run(adopted()) == ["old/0"]
    finally:
        stop_groups([impostor.pid], grace=5)


def test_a_failure_while_supervising_fails_the_shard_with_its_reason(tmp_path: Path) -> None:
    """Whatever goes wrong while a shard is supervised shows as the shard's error, never as a
    shard left starting: a log folder that cannot be made, or a driver that raises."""
    (tmp_path / "logs").write_text("a file where the log folder should be")

    class Broken:
        name = "broken"

        def launch(self, *_: object, **__: object) -> Launch:
            raise RuntimeError("the driver broke")

    def assignment(rid: str) -> ShardAssignment:
        return ShardAssignment(
            replica_id=rid, model="m", engine="sim", source="m", args=[], env={}, rank=0,
            num_shards=1, gpus=[0], engine_digest="d", startup_timeout=30,
        )  # fmt: skip

    async def go() -> None:
        settings = SupervisorSettings(backoff_base=60)
        async with httpx.AsyncClient() as http:
            no_logs = Shard(
                assignment("a"), driver_for("sim"), tmp_path / "logs", settings, lambda: None, http
            )
            broken = Shard(
                assignment("b"), Broken(), tmp_path / "other", settings, lambda: None, http
            )
            tasks = [asyncio.create_task(s.supervise()) for s in (no_logs, broken)]
            try:
                for shard in (no_logs, broken):
                    await until(
                        f"shard {shard.assignment.key} failed",
                        lambda s=shard: s.state is ShardState.FAILED,  # type: ignore[misc]
                    )
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        first = no_logs.report()
        assert str(tmp_path / "logs") in first.error and first.backoff_s == 60
        second = broken.report()
        assert second.error == "supervision failed: RuntimeError: the driver broke"
        assert second.state is ShardState.FAILED and second.failures == 1

    asyncio.run(go())


def test_an_engine_that_served_restarts_at_once_and_a_hung_one_is_restarted(
    tmp_path: Path,
) -> None:
    """A crash of an engine that was serving restarts it at once (the backoff here is a minute:
    waiting it out would fail the test). An engine that stops answering while it runs fails
    its liveness probes, is reported failed (so routers drop it) and is started again."""

    def sim(rid: str, *args: str) -> ShardAssignment:
        return ShardAssignment(
            replica_id=rid, model="m", engine="sim", source="m", args=list(args), env={},
            rank=0, num_shards=1, gpus=[0], engine_digest="d", startup_timeout=30,
        )  # fmt: skip

    settings = offline_agent(
        tmp_path,
        stop_grace=1.0,
        backoff_base=60,
        liveness_interval=0.2,
        liveness_timeout=0.3,
        liveness_failures=2,
    )

    async def go() -> None:
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            agent.apply(
                NodeAssignment(node="n", shards=[sim("crash"), sim("hung", "--hang-after", "2")])
            )
            crash, hung = agent.shards["crash/0"], agent.shards["hung/0"]
            await until("both ready", lambda: crash.state is hung.state is ShardState.READY)
            assert crash.proc is not None and hung.proc is not None
            first_crash, first_hung = crash.proc.pid, hung.proc.pid

            os.killpg(first_crash, signal.SIGKILL)
            await until(
                "the crashed engine started again and ready",
                lambda: crash.restarts == 1 and crash.state is ShardState.READY,
            )
            assert crash.proc.pid != first_crash and crash.failures == 1

            await until(
                "the hung engine failed its liveness probes",
                lambda: "health check failed" in hung.report().error,
            )
            assert hung.report().state is ShardState.FAILED
            await until(
                "the hung engine started again and ready",
                lambda: hung.restarts == 1 and hung.state is ShardState.READY,
            )
            assert hung.proc.pid != first_hung and not alive(first_hung)

            agent.apply(NodeAssignment(node="n", shards=[]))
            await until("both engines stopped", lambda: not agent.stopping)

    asyncio.run(go())


def test_an_engine_gets_an_explicit_environment_not_its_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's token (and anything else it holds) stays with it: an engine gets PATH and
    the like, its GPUs, what the catalog names, and what the agent passes on by name."""
    monkeypatch.setenv("MODELFLEET_AGENT_TOKEN", "agent-secret-0123456789")
    monkeypatch.setenv("SOME_CLOUD_KEY", "cloud-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-token-passed-on")
    out = tmp_path / "env.txt"
    script = (
        "import os,sys,time; open(sys.argv[1],'w').write(repr(dict(os.environ))); time.sleep(60)"
    )
    dump = f'{sys.executable} -c "{script}" {out}'
    shard = ShardAssignment(
        replica_id="env", model="m", engine="command", source="m", args=[],
        env={"FROM_CATALOG": "yes"}, command=dump, rank=0, num_shards=1, gpus=[1],
        engine_digest="d", startup_timeout=30,
    )  # fmt: skip
    settings = offline_agent(tmp_path, stop_grace=1.0, pass_env=("HF_TOKEN",))

    async def go() -> dict[str, str]:
        async with Agent(settings, SimulatedGpus("2x80GB")) as agent:
            agent.apply(NodeAssignment(node="n", shards=[shard]))
            await until(
                "the engine wrote its environment", lambda: out.exists() and out.read_text()
            )
            agent.apply(NodeAssignment(node="n", shards=[]))
            await until("the engine stopped", lambda: not agent.stopping)
        return dict(ast.literal_eval(out.read_text()))

    env = asyncio.run(go())
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["FROM_CATALOG"] == "yes"
    assert env["HF_TOKEN"] == "hf-token-passed-on" and env["PATH"] == os.environ["PATH"]
    assert "MODELFLEET_AGENT_TOKEN" not in env and "SOME_CLOUD_KEY" not in env


def test_every_listener_closes_a_slow_head_and_refuses_an_oversized_one(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue 39: the control plane's listeners (and the agent's admin API, and the engine
    simulator) never closed a slowloris; 20,100 half-sent requests took every file
    descriptor. Each now has the router's bounds: a head not in within 10 s gets 408 and the
    connection closed; a head over 64 KB gets 431."""
    import socket
    import threading
    from urllib.parse import urlsplit

    engine, _ = start_engine(procs, tmp_path, "m")
    (tmp_path / "catalog.yaml").write_text("models: []\n")
    config = {"catalog": str(tmp_path / "catalog.yaml"), "state_dir": str(tmp_path / "cp"),
              "admin_token": "admin-token-of-the-test", "agent_token": "a" * 20,
              "agent_port": 0, "admin_port": 0}  # fmt: skip
    (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
    cp = procs.start("control-plane", "--config", str(tmp_path / "cp.yaml"), "--ready-file",
                     str(tmp_path / "cp.json"), log="cp")  # fmt: skip
    urls = wait_json(tmp_path / "cp.json", cp)["urls"]
    agent = procs.start(
        "agent", "--control-plane", urls["agent"], "--node", "n", "--simulate-gpus", "1x80GB",
        "--token", "a" * 20, "--state-dir", str(tmp_path / "n"), "--admin-port", "0",
        "--ready-file", str(tmp_path / "agent.json"), log="agent",
    )  # fmt: skip
    agent_admin = wait_json(tmp_path / "agent.json", agent)["urls"]["admin"]
    targets = {"engine": engine, "cp agent API": urls["agent"], "cp admin API": urls["admin"],
               "agent admin API": agent_admin}  # fmt: skip
    found: dict[str, tuple[str, str]] = {}

    def attack(name: str, url: str) -> None:
        where = urlsplit(url)
        address = (where.hostname or "127.0.0.1", where.port or 80)
        with socket.create_connection(address, timeout=30) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and no more
            answer = slow.recv(200).decode(errors="replace")
            closed = slow.recv(200) == b""
        with socket.create_connection(address, timeout=30) as big:
            big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"y" * 70_000)
            too_big = big.recv(200).decode(errors="replace")
        found[name] = (answer.splitlines()[0] if answer else f"closed={closed}",
                       too_big.splitlines()[0] if too_big else "")  # fmt: skip
        if not closed:
            found[name] = ("not closed", found[name][1])

    threads = [threading.Thread(target=attack, args=item) for item in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert found == {
        name: ("HTTP/1.1 408 Request Timeout", "HTTP/1.1 431 Request Header Fields Too Large")
        for name in targets
    }, found
    assert httpx.get(engine + "/health", timeout=10).status_code == 200  # it still serves


def test_an_engines_whole_process_tree_ends_before_it_starts_again(tmp_path: Path) -> None:
    """An engine is every process of its group: when its server dies (kill -9 of the leader
    alone, as a crash would), the workers it started are ended before it starts again, one
    ignoring SIGTERM killed after the grace; when it is stopped, its workers end with it."""
    workers = tmp_path / "workers"
    stubborn = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    # A server that starts two workers (one deaf to SIGTERM) and then becomes the simulator.
    script = (
        f"{sys.executable} -c 'import time; time.sleep(600)' & echo $! >> {workers}; "
        f'{sys.executable} -c "{stubborn}" & echo $! >> {workers}; '
        f"exec {sys.executable} -m modelfleet engine-sim --model m --host {{host}} --port {{port}}"
    )
    assignment = ShardAssignment(
        replica_id="tree", model="m", engine="command", source="m", args=[], env={},
        command=f"sh -c {shlex.quote(script)}", rank=0, num_shards=1, gpus=[0],
        engine_digest="d", startup_timeout=30,
    )  # fmt: skip

    def started() -> list[int]:
        return [int(p) for p in workers.read_text().split()] if workers.exists() else []

    settings = offline_agent(tmp_path / "agent", stop_grace=1.0, backoff_base=60)

    async def go() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            agent.apply(NodeAssignment(node="n", shards=[assignment]))
            shard = agent.shards["tree/0"]
            await until("the engine ready", lambda: shard.state is ShardState.READY)
            first = started()
            assert len(first) == 2 and all(alive(p) for p in first)
            assert shard.proc is not None
            os.kill(shard.proc.pid, signal.SIGKILL)  # the server only, not its group
            await until(
                "the engine started again", lambda: shard.restarts == 1 and len(started()) == 4
            )
            assert not any(alive(p) for p in first)  # gone before the next run began
            await until("the engine ready again", lambda: shard.state is ShardState.READY)
            second = started()[2:]
            assert all(alive(p) for p in second)
            agent.apply(NodeAssignment(node="n", shards=[]))
            await until("the shard stopped", lambda: not agent.stopping)
            assert not any(alive(p) for p in second)

    try:
        asyncio.run(go())
    finally:
        stop_groups([p for p in started() if alive(p)], grace=1)


def test_an_agent_ends_the_workers_of_an_engine_that_died_while_it_was_down(
    tmp_path: Path,
) -> None:
    """An engine whose server died while no agent ran is not adopted, and what is left of its
    group (its workers, holding their GPUs) is ended before anything else starts there."""
    leader = subprocess.Popen(
        [
            "sh",
            "-c",
            f"{sys.executable} -c 'import time; time.sleep(600)' >/dev/null & echo $!; read x",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    worker = int(leader.stdout.readline())
    identity = ProcessId.of(leader.pid)
    assert identity is not None
    leader.communicate(timeout=10)  # the server gone; its worker is not
    try:
        assert alive(worker) and os.getpgid(worker) == leader.pid
        assignment = ShardAssignment(
            replica_id="old", model="m", engine="sim", source="m", args=[], env={}, rank=0,
            num_shards=1, gpus=[0], engine_digest="d", startup_timeout=30,
        )  # fmt: skip
        engine = EngineRecord(
            assignment=assignment, pid=leader.pid, process_started=identity.started, port=9
        )
        write_records(tmp_path, {assignment.key: engine})

        async def adopted() -> list[str]:
            async with Agent(offline_agent(tmp_path, stop_grace=1.0), SimulatedGpus("1x80GB")) as a:
                return await a.adopt()

        assert asyncio.run(adopted()) == []
        assert not alive(worker)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
