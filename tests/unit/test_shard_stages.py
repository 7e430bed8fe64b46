"""Each stage of a shard's supervision driven alone, without an agent: what starts its engine
(`agent/start.py`), the engine asked over HTTP (`agent/probe.py`), an engine taken over from
an earlier agent (`agent/adopt.py`), and its process group stopped (`agent/stop.py`).
`tests/integration/test_processes.py` drives them together through `Shard`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from modelfleet.agent.adopt import still_running
from modelfleet.agent.probe import EngineHttp
from modelfleet.agent.records import EngineRecord
from modelfleet.agent.settings import EngineTls, SupervisorSettings
from modelfleet.agent.start import ENGINE_KEY_PREFIX, CannotStart, launch, spawn
from modelfleet.agent.stop import terminate
from modelfleet.engines import NoDriver
from modelfleet.engines.sim import SimDriver
from modelfleet.host.processes import ProcessId
from modelfleet.messages.wire import ShardAssignment, ShardState
from modelfleet.security.pki import TlsFiles


def assignment(gpus: tuple[int, ...] = (0,)) -> ShardAssignment:
    return ShardAssignment(
        replica_id="m-1", model="m", engine="sim", source="m", args=[], env={}, rank=0,
        num_shards=1, gpus=list(gpus), engine_digest="d", startup_timeout=30,
    )  # fmt: skip


# -- start -----------------------------------------------------------------------------------


def test_a_launch_names_the_engine_its_port_and_a_fresh_key_without_starting_it() -> None:
    got = launch(assignment(), SimDriver(), SupervisorSettings(), leader=None)
    assert got.local_port is None and got.key.startswith(ENGINE_KEY_PREFIX)
    assert "--port" in got.launch.argv and str(got.port) in got.launch.argv
    again = launch(assignment(), SimDriver(), SupervisorSettings(), leader=None)
    assert again.key != got.key


def test_behind_a_gate_the_engine_listens_on_loopback_and_the_gate_where_routers_reach() -> None:
    tls = EngineTls(TlsFiles(Path("n.crt"), Path("n.key")), Path("ca.crt"))
    settings = SupervisorSettings(engine_host="127.0.0.2", engine_tls=tls)
    got = launch(assignment(), SimDriver(), settings, leader=None)
    argv = got.launch.argv
    assert argv[argv.index("--listen") + 1] == f"127.0.0.2:{got.port}"
    assert got.local_port is not None
    assert argv[argv.index("--engine-port") + 1] == str(got.local_port)
    engine = argv[argv.index("--") + 1 :]
    assert engine[engine.index("--host") + 1] == "127.0.0.1"


def test_what_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(CannotStart, match="no driver"):
        launch(assignment(), NoDriver("no driver for engine 'x'"), SupervisorSettings(), None)
    slots = SupervisorSettings(cpu_slots={0: (0, 1)})
    with pytest.raises(CannotStart, match=r"no CPU slot \[3\]"):
        launch(assignment((3,)), SimDriver(), slots, None)
    got = launch(assignment(), SimDriver(), SupervisorSettings(), None)
    missing = got.launch.__class__(["/no/such/engine"], {})
    with pytest.raises(CannotStart, match="cannot start /no/such/engine"):
        # (A log in a folder of its own: spawn makes the log's folder private.)
        spawn(got.__class__(missing, got.port, None, got.key), tmp_path / "logs" / "x", {}, ())


# -- probe -----------------------------------------------------------------------------------


def test_every_call_to_the_engine_carries_its_key_and_says_what_went_wrong() -> None:
    seen: list[tuple[str, str | None]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": True})
        if request.url.path == "/sleep":
            return httpx.Response(500)
        return httpx.Response(200)

    async def go() -> tuple[bool, str | None, bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as http:
            asked = EngineHttp(http, "http://engine", "mfe-key")
            return (
                await asked.healthy("/health"),
                await asked.post("/sleep", 5),
                (await asked.sleeping()),
            )

    assert asyncio.run(go()) == (True, "HTTP 500", True)
    assert seen == [(p, "Bearer mfe-key") for p in ("/health", "/sleep", "/is_sleeping")]


def test_an_engine_that_cannot_be_reached_is_not_healthy() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def go() -> tuple[bool, str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refused)) as http:
            asked = EngineHttp(http, "http://engine", None)
            return await asked.healthy("/health"), await asked.post("/wake_up", 5)

    healthy, why = asyncio.run(go())
    assert not healthy and why is not None and why.startswith("ConnectError")


# -- adopt and stop --------------------------------------------------------------------------


def record(pid: int | None, started: float | None) -> EngineRecord:
    return EngineRecord(
        assignment=assignment(), pid=pid, process_started=started, port=1, local_port=None,
        dist_port=None, argv=[], health_path="/health", started_at=0.0, ready_at=None,
        engine_key=None, restarts=0, state=ShardState.READY,
    )  # fmt: skip


def test_only_that_very_process_is_adopted_and_stopping_it_ends_its_group() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        me = ProcessId.of(proc.pid)
        assert me is not None
        adopted = still_running(record(proc.pid, me.started))
        assert adopted is not None and adopted.pid == proc.pid and adopted.poll() is None
        assert still_running(record(proc.pid, me.started - 10)) is None  # a reused pid
        assert still_running(record(None, None)) is None
        asyncio.run(terminate(adopted, grace=5, key="m-1/0"))
        deadline = time.monotonic() + 10
        while adopted.poll() is None:  # our child: reaped by wait() below, seen gone here
            proc.poll()
            assert time.monotonic() < deadline, "the engine's group did not stop"
            time.sleep(0.02)
        assert adopted.poll() == -1  # not this agent's child: its exit code is unknown
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
