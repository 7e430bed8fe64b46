"""End to end: `modelfleet up` as a newcomer runs it, driven with the official openai client."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.processes import running as alive
from modelfleet.host.processes import stop_groups
from modelfleet.http.loadgen import SteadyClient
from modelfleet.up.children import stop_leftovers

from .conftest import Procs, wait_for, wait_json


def ctl(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelfleet", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def all_pids(pids: dict) -> list[int]:
    found: list[int] = []
    for value in pids.values():
        if isinstance(value, int):
            found.append(value)
        elif isinstance(value, dict):
            found += all_pids(value)
        elif isinstance(value, list):
            found += value
    return found


def test_up_serves_every_model_and_stops_everything(procs: Procs, tmp_path: Path) -> None:
    state = tmp_path / "state"
    started = time.monotonic()
    up = procs.start("up", "--state-dir", str(state), log="up")
    info = wait_json(state / "up.json", up, timeout=20)
    print(f"up wrote up.json {time.monotonic() - started:.1f}s after it started")
    # The files that hold its tokens and API key are its owner's alone, and so is the folder.
    for name in ("up.json", "control-plane.yaml", "router.yaml"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    for folder in (state, state / "control-plane", state / "agents" / "node-1"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for key in ("router_url", "admin_url", "admin_token", "api_key", "pids"):
        assert info[key], key
    printed = procs.log("up")
    assert info["router_url"] in printed and info["api_key"] in printed and "curl" in printed
    # The ctl commands it prints work as printed, from another folder too: with --state-dir
    # they once failed ("no .modelfleet/up.json") and said nothing of --state-dir.
    commands = [line.strip() for line in printed.splitlines() if "modelfleet ctl" in line]
    assert commands and all(f"--state-dir {state}" in c for c in commands), commands
    shown = subprocess.run(
        [sys.executable, "-m", *commands[0].split()],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert shown.returncode == 0 and "node-1" in shown.stdout, shown.stderr

    pids = info["pids"]
    assert set(pids["agent"]) == {"node-1", "node-2"}
    engines = [p for node in pids["engine"].values() for p in node]
    assert len(engines) == 3  # the default catalog: 2 + 1 replicas
    everything = all_pids(pids)
    assert all(alive(p) for p in everything)
    # Everything in the state dir is its owner's alone: the store and its WAL, the logs, the
    # agents' records and engine logs once were 0644 in folders of 0755.
    wait_for("the engines' logs", lambda: len(list(state.glob("agents/*/logs/*"))) >= 3)
    loose = [
        f"{path.relative_to(state)} {stat.S_IMODE(path.stat().st_mode):o}"
        for path in [state, *state.rglob("*")]
        if path.name != "catalog.yaml"  # the operator's to edit; it holds no secret
        and stat.S_IMODE(path.stat().st_mode) != (0o700 if path.is_dir() else 0o600)
    ]
    assert not loose, loose

    client = openai.OpenAI(
        base_url=info["router_url"] + "/v1", api_key=info["api_key"], max_retries=0
    )
    models = [m.id for m in client.models.list()]
    assert sorted(models) == ["sim-chat", "sim-large"]
    for name in models:
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        assert reply.usage.prompt_tokens == 2

        chunks = list(
            client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "Stream it"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == 4
        usage = [c.usage for c in chunks if c.usage]
        assert usage and usage[-1].completion_tokens == 4

    bad = openai.OpenAI(base_url=info["router_url"] + "/v1", api_key="mf-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        bad.chat.completions.create(model="sim-chat", messages=[{"role": "user", "content": "x"}])
    assert denied.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="sim-chat", messages=[])  # type: ignore[arg-type]

    # ctl finds the fleet through up.json in the state dir, as a table and as JSON.
    table = ctl("nodes", "--state-dir", str(state))
    assert table.returncode == 0, table.stderr
    assert "node-1" in table.stdout and "node-2" in table.stdout
    as_json = json.loads(ctl("nodes", "--state-dir", str(state), "-o", "json").stdout)
    assert {n["name"] for n in as_json["nodes"]} == {"node-1", "node-2"}
    assert all(len(n["gpus"]) == 4 and n["ready"] for n in as_json["nodes"])
    replicas = json.loads(ctl("replicas", "--state-dir", str(state), "-o", "json").stdout)
    assert sorted(r["model"] for r in replicas["replicas"]) == ["sim-chat", "sim-chat", "sim-large"]
    assert all(r["state"] == "ready" for r in replicas["replicas"])
    explained = ctl("explain-placement", "sim-large", "--state-dir", str(state))
    assert (
        explained.returncode == 0 and "node-1" in explained.stdout and "node-2" in explained.stdout
    )
    # ... and with no flags from the folder holding the default state dir.
    default_dir = tmp_path / "cwd"
    (default_dir / ".modelfleet").mkdir(parents=True)
    (default_dir / ".modelfleet" / "up.json").write_text((state / "up.json").read_text())
    assert "node-1" in ctl("replicas", cwd=default_dir).stdout

    # A wrong token, or an admin API that is not there: one line, non-zero exit.
    wrong = ctl("nodes", "--admin", info["admin_url"], "--token", "nope")
    assert wrong.returncode != 0 and "refused the token" in wrong.stderr
    assert "Traceback" not in wrong.stderr and len(wrong.stderr.strip().splitlines()) == 1
    gone = ctl(
        "nodes", env={"MODELFLEET_ADMIN_URL": "http://127.0.0.1:9", "MODELFLEET_ADMIN_TOKEN": "t"}
    )
    assert gone.returncode != 0 and "cannot reach" in gone.stderr and "Traceback" not in gone.stderr

    # `up` is a service manager: a process of the fleet that dies is started again, and up.json
    # says so. The router comes back on its port; an agent comes back and adopts its engines.
    node1 = state / "agents" / "node-1"
    engines_before = recorded_engine_pids(node1)
    pickers = {"router": lambda p: p["router"], "agent": lambda p: p["agent"]["node-1"]}
    for role, pick in pickers.items():
        old = pick(pids)
        os.kill(old, signal.SIGKILL)

        def restarted(pick: Callable[[dict[str, Any]], int] = pick, old: int = old) -> int | None:
            new = pick(json.loads((state / "up.json").read_text())["pids"])
            return new if new != old and alive(new) else None

        everything.append(wait_for(f"{role} restarted by up", restarted))

    # The new router starts with an empty table; the control plane's timed re-push (10 s)
    # fills it.
    def serves() -> bool:
        body = {"model": "sim-chat", "messages": [{"role": "user", "content": "back?"}]}
        headers = {"authorization": f"Bearer {info['api_key']}"}
        url = info["router_url"] + "/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=10).status_code == 200

    wait_for("the restarted router to serve", serves, timeout=20)
    admin = httpx.Client(
        base_url=info["admin_url"], headers={"authorization": f"Bearer {info['admin_token']}"}
    )

    def heard() -> int:
        nodes = admin.get("/v1/nodes").json()["nodes"]
        node = next(n for n in nodes if n["name"] == "node-1")
        return int(node["reports"]) + int(node["heartbeats"])

    seen = heard()
    wait_for("three reports or heartbeats of the restarted agent", lambda: heard() >= seen + 3)
    engines_after = recorded_engine_pids(node1)
    assert engines_after == engines_before and all(alive(p) for p in engines_after)
    assert "restarted: pid" in procs.log("up")

    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=60) == 0
    # up waited for everything it stopped, so nothing of it runs now. Engines may have restarted
    # since up.json was written: check what the agents recorded too.
    assert [p for p in everything if alive(p)] == []
    assert not (state / "up.json").exists()
    for node in ("node-1", "node-2"):
        assert [p for p in recorded_engine_pids(state / "agents" / node) if alive(p)] == []


def test_one_up_per_state_dir_and_an_up_after_a_killed_one_duplicates_nothing(
    procs: Procs, tmp_path: Path
) -> None:
    """A second `up` on a state dir in use refuses, naming the first. kill -9 of `up` leaves its
    fleet running; the next `up` stops the control plane and agents the dead one left (their
    engines excepted: the new agents adopt them) instead of starting a second fleet over the
    same state, adopts its router, which serves on throughout (a new router refused 19 of 960
    requests in 0.9 s), and keeps the first one's API key, admin token and URLs."""
    state = tmp_path / "state"
    first = procs.start("up", "--state-dir", str(state), log="up1")
    info = wait_json(state / "up.json", first, timeout=30)
    client = SteadyClient(info["router_url"], info["api_key"], "sim-chat", max_tokens=2)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "modelfleet", "up", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 1 and f"modelfleet up pid {first.pid}" in second.stderr

        nodes = ("node-1", "node-2")
        engines = {n: recorded_engine_pids(state / "agents" / n) for n in nodes}
        pids = info["pids"]
        own = [pids["control-plane"], *pids["agent"].values()]
        client.start()
        wait_for("requests through the router", lambda: client.ok >= 20)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert all(alive(p) for p in [*own, pids["router"]])  # orphaned by the kill

        third = procs.start("up", "--state-dir", str(state), log="up3")
        wait_for(
            "the new up to be ready",
            lambda: json.loads((state / "up.json").read_text())["pid"] == third.pid,
        )
        assert "left" in procs.log("up3") and "stopped them" in procs.log("up3")
        assert "router an earlier `up` left running serves on: adopted" in procs.log("up3")
        done = client.ok
        wait_for("requests through the adopted router", lambda: client.ok >= done + 20)
        client.stop()
        assert client.failures == [], client.failures[:5]
        # What clients and operators were given still holds: same key, token and URLs, and
        # the same router process.
        again = json.loads((state / "up.json").read_text())
        for kept in ("api_key", "admin_token", "router_url", "admin_url"):
            assert again[kept] == info[kept], kept
        assert again["pids"]["router"] == pids["router"]
        answer = (
            openai.OpenAI(base_url=f"{info['router_url']}/v1", api_key=info["api_key"])
            .with_options(timeout=20, max_retries=0)
            .completions.create(model="sim-chat", prompt="still here?", max_tokens=3)
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        assert [p for p in own if alive(p)] == []
        after = {n: recorded_engine_pids(state / "agents" / n) for n in nodes}
        assert after == engines and all(alive(p) for ps in after.values() for p in ps)
        third.send_signal(signal.SIGINT)
        assert third.wait(timeout=60) == 0
        assert not alive(pids["router"])  # the adopted router is stopped like its own
    finally:
        client.stop()
        left = stop_leftovers(state)
        stop_groups([p.pid for p in left.adoptable.values()], 10.0)


def test_up_gives_its_router_a_redis_and_keeps_the_choice(procs: Procs, tmp_path: Path) -> None:
    """`up --redis` runs Debian's redis-server in the state dir and the router counts keys'
    limits there; the next `up` keeps that (router.yaml was written anew at every start with
    no way to name a limits store); `--limits-store ''` goes back to the router's memory.

    That Redis asks a password (it took none: any local process could read the keys' names
    or FLUSHALL their counts), set in its config file (0600), never on a command line; the
    router has it in router.yaml (0600). It is kept: an `up` after a kill -9 adopts the Redis
    and the router left running, and the counts go on."""
    import redis

    state = tmp_path / "state"

    def run_up(*flags: str, log: str) -> tuple[Any, dict[str, Any]]:
        proc = procs.start("up", "--state-dir", str(state), *flags, log=log)
        wait_for(
            f"{log} to be ready",
            lambda: (
                (state / "up.json").exists()
                and json.loads((state / "up.json").read_text())["pid"] == proc.pid
            ),
            timeout=30,
        )
        return proc, json.loads((state / "up.json").read_text())

    def stop(proc: Any) -> None:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0

    def limits_store() -> Any:
        return yaml.safe_load((state / "router.yaml").read_text()).get("limits_store")

    first, info = run_up("--redis", log="up-redis")
    url = limits_store()
    assert url and url.startswith("redis://:")
    redis_pid = info["pids"]["redis"]
    assert alive(redis_pid)
    password = redis.Redis.from_url(url).connection_pool.connection_kwargs["password"]
    assert len(password) >= 24
    port = redis.Redis.from_url(url).connection_pool.connection_kwargs["port"]
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: no password, no answer
        redis.Redis(host="127.0.0.1", port=port).keys("*")
    conf = state / "redis" / "redis.conf"
    assert f"requirepass {password}" in conf.read_text()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "router.yaml").stat().st_mode) == 0o600
    for pid in (redis_pid, info["pids"]["router"]):
        assert not any(password in arg for arg in psutil.Process(pid).cmdline())
    target = ["--admin", info["admin_url"], "--token", info["admin_token"]]
    made = ctl("keys", "create", "limited", "--rpm", "2", "-o", "json", *target)
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]

    def statuses() -> list[int]:
        body = {"model": "sim-chat", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"authorization": f"Bearer {key}"}
        return [
            httpx.post(f"{info['router_url']}/v1/chat/completions", json=body, headers=headers,
                       timeout=10).status_code
            for _ in range(3)
        ]  # fmt: skip

    wait_for("the router to take the new key", lambda: statuses()[0] != 401)
    assert statuses()[-1] == 429
    counted = redis.Redis.from_url(url).keys("modelfleet:limits:limited:*")
    assert counted, "nothing of the key was counted in Redis"
    stop(first)
    assert not alive(redis_pid)  # stopped with the fleet

    second, info = run_up(log="up-again")
    assert limits_store() == url and alive(info["pids"]["redis"])  # kept
    wait_for("the key limited again", lambda: statuses()[-1] == 429)
    os.kill(second.pid, signal.SIGKILL)  # its Redis and router are left running
    second.wait()
    third, again = run_up(log="up-after-kill")
    assert "the Redis an earlier `up` left running serves on: adopted" in procs.log("up-after-kill")
    assert again["pids"]["redis"] == info["pids"]["redis"] and limits_store() == url
    assert again["pids"]["router"] == info["pids"]["router"]
    assert redis.Redis.from_url(url).keys("modelfleet:limits:limited:*")  # counts kept
    assert statuses()[-1] == 429
    stop(third)
    logs = [*(state / "logs").rglob("*.log"), *tmp_path.glob("up-*.log")]
    assert [log for log in logs if password in log.read_text(errors="replace")] == []

    fourth, info = run_up("--limits-store", "", log="up-memory")
    assert limits_store() is None and "redis" not in info["pids"]
    stop(fourth)


def test_up_on_real_gpus_without_nvml_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    """`up --gpus nvml` reads the machine's GPUs through NVML; where NVML cannot be loaded
    (this machine has no NVIDIA driver) it stops with the reason and starts nothing else.
    bench/gpu_check.py runs it where there are GPUs."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML: bench/gpu_check.py checks `up --gpus nvml` here")
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "modelfleet", "up", "--gpus", "nvml", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "no GPUs to report: NVML" in said, said
    left = stop_leftovers(state)  # what an `up` left running, if anything
    assert left.stopped == [], left.stopped


# A process of the fleet as `up` runs one, that starts as its directory's `mode` file says:
# ready at once, slow (waiting for its store until `go` appears), or failing at its start.
CHILD = """
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
mode = (d / "mode").read_text()
if mode == "fail":
    print("error: cannot listen on 127.0.0.1:9999: the address is in use", flush=True)
    sys.exit(3)
if mode == "slow":
    print("the store postgresql://db:5432 is unreachable; waiting for it", flush=True)
    while not (d / "go").exists():
        time.sleep(0.05)
(d / "ready").write_text(str(os.getpid()))
time.sleep(600)
"""


def test_up_tells_a_slow_restart_from_a_failed_one_and_keeps_no_dead_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`up` said a control plane or router "did not come back" when it was slow (waiting
    for its store) and kept the dead pid in up.json; now a slow one is said to be still
    starting, with what it waits for, and followed until it is ready; one that exited is
    said to have, with its exit and its log's last lines; a pid that is gone is left out."""
    from modelfleet.up.children import Fleet
    from modelfleet.up.restarts import SLOW_AFTER_S, Restarts

    (tmp_path / "mode").write_text("ready")
    fleet = Fleet(tmp_path / "state")

    def ready() -> dict[str, Any] | None:
        marker = tmp_path / "ready"
        pid = marker.read_text() if marker.exists() else ""
        return {"urls": {}} if pid == str(child.proc.pid) else None

    child = fleet.spawn("router", [], command=[sys.executable, "-c", CHILD, str(tmp_path)],
                        ready_check=ready)  # fmt: skip
    # What `Restarts` reads of a running fleet: its processes and its agents' addresses.
    running: Any = type("Running", (), {"fleet": fleet, "agent_admin": {}})()
    keeper = Restarts()
    try:
        fleet.wait_ready(child, 15)
        first = child.proc.pid
        (tmp_path / "mode").write_text("slow")
        os.kill(first, signal.SIGKILL)
        child.proc.wait()
        assert fleet.pids().get("router") is None  # gone: not in up.json
        assert keeper.tend(running, lambda: False, time.monotonic())  # restarted at once
        assert "was killed by signal 9" in capsys.readouterr().out
        second = child.proc.pid
        assert second != first and fleet.pids()["router"] == second

        wait_for("the store line", lambda: "unreachable" in child.log.read_text())
        later = child.started_at + SLOW_AFTER_S + 1  # the clock `up` passes, moved on
        assert not keeper.tend(running, lambda: False, later)
        said = capsys.readouterr().out
        assert "is still starting after 16s, not failed" in said, said
        assert "postgresql://db:5432 is unreachable; waiting for it" in said
        assert "did not come back" not in said and child.proc.pid == second
        (tmp_path / "go").touch()
        wait_for("the router ready", lambda: keeper.tend(running, lambda: False, later + 1))
        assert f"router restarted: pid {second}, ready after" in capsys.readouterr().out

        (tmp_path / "mode").write_text("fail")
        os.kill(second, signal.SIGKILL)
        child.proc.wait()
        assert keeper.tend(running, lambda: False, later + 2)  # its death is said
        assert keeper.tend(running, lambda: False, later + 60)  # started again, when due
        assert child.proc.pid != second
        capsys.readouterr()
        child.proc.wait(10)
        # It exited within a second of its start: said, and left out until it runs again.
        assert keeper.tend(running, lambda: False, child.started_at + 1)
        said = capsys.readouterr().out
        assert "router exited with code 3; the last lines of" in said, said
        assert "the address is in use" in said and "restarting it in" in said
        assert fleet.pids().get("router") is None
    finally:
        fleet.stop()
