"""Secrets that stay secret, with real processes: engines nobody reaches around the router,
no token or key in any log, none left in /tmp by a killed router, no engine address shown to
tenants, and refusals that name the setting that fixes them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import yaml

from modelfleet.agent.records import read_records

from .conftest import Operator, Procs, fleet_of, wait_for
from .test_processes import KEY, PUSH_TOKEN, start_engine, start_router
from .test_router_data_path import two_workers


def test_engines_need_their_key_and_no_secret_reaches_a_log(tmp_path: Path) -> None:
    model = {"name": "a", "engine": "sim"}
    with fleet_of(tmp_path, [model]) as fleet:
        op = Operator(fleet, tmp_path)
        [replica] = wait_for(
            "a ready", lambda: [r for r in op.replicas("a") if r["state"] == "ready"]
        )
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        # Straight to the engine: refused. Through the router, with a client's key: served.
        direct = httpx.post(f"{replica['endpoint']}/v1/chat/completions", json=body, timeout=10)
        assert direct.status_code == 401
        assert httpx.get(f"{replica['endpoint']}/health", timeout=10).status_code == 200
        assert op.client.post("/v1/chat/completions", json=body).status_code == 200

        state = fleet.fleet.state_dir
        engine_keys = [
            r.engine_key
            for node in ("node-1", "node-2")
            for r in read_records(state / "agents" / node).values()
            if r.engine_key
        ]
        assert len(engine_keys) == 1 and engine_keys[0].startswith("mfe-")

        # Operators see that a key is set, never the key.
        shown = op.ctl("replicas", "show", replica["id"]).stdout
        assert "ENGINE KEY" in shown and "set" in shown
        views = [
            shown,
            op.ctl("replicas", "-o", "json").stdout,
            op.ctl("replicas", "show", replica["id"], "-o", "json").stdout,
            json.dumps(op.get("/v1/routing")),
            httpx.get(
                f"{fleet.push_url}/v1/routing",
                headers={"authorization": f"Bearer {fleet.admin_token}"},
            ).text,
        ]
        assert not any(engine_keys[0] in v for v in views)
        assert json.loads(views[2])["shards"][0]["engine_key_set"] is True

        # Wrong credentials everywhere: refused, and what was sent is not written anywhere.
        wrong = "wrong-" + "x" * 30
        bad = {"authorization": f"Bearer {wrong}"}
        assert (
            httpx.post(
                f"{fleet.router_url}/v1/chat/completions", json=body, headers=bad
            ).status_code
            == 401
        )
        assert httpx.get(f"{fleet.admin_url}/v1/nodes", headers=bad).status_code == 401
        assert (
            httpx.put(f"{fleet.push_url}/v1/routing", content=b"{}", headers=bad).status_code == 401
        )
        agent_api = json.loads((state / "run" / "control-plane.json").read_text())["urls"]["agent"]
        assert httpx.post(f"{agent_api}/v1/report", content=b"{}", headers=bad).status_code == 401
        ctl = [sys.executable, "-m", "modelfleet", "ctl", "nodes", "--admin", fleet.admin_url]
        refused = subprocess.run(
            [*ctl, "--token", wrong], capture_output=True, text=True, timeout=30
        )
        assert refused.returncode == 1 and wrong not in refused.stderr

    secrets = {
        "admin token": fleet.admin_token,
        "agent token": fleet.agent_token,
        "api key": fleet.api_key,
        "engine key": engine_keys[0],
        "a wrong token sent": wrong,
    }
    logs = sorted(state.rglob("*.log"))
    assert len(logs) >= 5  # router, control plane, two agents, an engine
    leaks = [
        f"{name} in {log.relative_to(state)}"
        for log in logs
        for name, secret in secrets.items()
        if secret in log.read_text(errors="replace")
    ]
    assert leaks == []


def test_a_router_killed_leaves_its_workers_folder_to_the_next_router_start(
    procs: Procs, tmp_path: Path
) -> None:
    """A router of several workers keeps their configs (with its push token, the fleet's admin
    token under `up`) in a private folder in /tmp; kill -9 left it there for good. It is named
    with its owner's pid now, and the next router to start removes those whose owner is gone."""
    _, proc, found = two_workers(procs, tmp_path)
    worker = psutil.Process(found["workers"][0])
    folder = Path(worker.cmdline()[worker.cmdline().index("--config") + 1]).parent
    assert PUSH_TOKEN in (folder / "worker-0.yaml").read_text()
    assert folder.name.startswith(f"modelfleet-router-{proc.pid}-")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    workers = [psutil.Process(pid) for pid in found["workers"]]
    wait_for(
        "the workers to end with their parent",
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
    )
    assert folder.is_dir()  # nobody was left to remove it

    again = tmp_path / "again"
    again.mkdir()
    start_router(procs, again, [])  # one worker: it makes no folder, and sweeps all the same
    assert not folder.exists()
    assert "which a router killed before it stopped left" in procs.log("router")


def test_router_metrics_are_not_served_to_tenants(procs: Procs, tmp_path: Path) -> None:
    """The router's /metrics names every engine's address (ejections, per endpoint); it was
    served on the client port to anyone, no key asked. It is on the push listener now, behind
    its token, where the control plane and Prometheus read it."""
    engine, _ = start_engine(procs, tmp_path, "m")
    router = start_router(
        procs, tmp_path, [{"name": "m", "endpoints": [engine]}], push_token=PUSH_TOKEN
    )
    push = json.loads((tmp_path / "router.json").read_text())["urls"]["push"]
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    key = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{router}/v1/completions", json=body, headers=key, timeout=10).is_success
    for who in ({}, key):
        page = httpx.get(f"{router}/metrics", headers=who, timeout=10)
        assert page.status_code == 404 and engine not in page.text
    assert httpx.get(f"{push}/metrics", headers=key, timeout=10).status_code == 401
    admin = {"authorization": f"Bearer {PUSH_TOKEN}"}
    page = httpx.get(f"{push}/metrics", headers=admin, timeout=10)
    assert page.status_code == 200
    assert 'modelfleet_router_requests_total{model="m",status="200"} 1.0' in page.text


def test_refusals_of_a_secret_left_readable_name_the_setting_that_fixes_them(
    tmp_path: Path,
) -> None:
    """A router config with its push token, readable by others, was refused with advice to
    set `admin_token_file`, a key the router does not have; an agent's --token-file so, with
    the same. Each now names its own: push_token_file, and chmod alone for a token's file."""
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"port": 0, "push_port": 0, "push_token": PUSH_TOKEN}))
    os.chmod(config, 0o644)
    refused = subprocess.run(
        [sys.executable, "-m", "modelfleet", "router", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = " ".join(refused.stderr.split())
    assert refused.returncode != 0 and f"chmod 600 {config}" in said, said
    assert "push_token_file: PATH" in said and "admin_token" not in said

    token = tmp_path / "agent-token"
    token.write_text("shared-agent-token-of-the-test")
    os.chmod(token, 0o644)
    refused = subprocess.run(
        [sys.executable, "-m", "modelfleet", "agent", "--control-plane", "http://127.0.0.1:9",
         "--node", "n", "--simulate-gpus", "1x80GB", "--state-dir", str(tmp_path / "agent"),
         "--token-file", str(token)],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MODELFLEET_AGENT_TOKEN"},
    )  # fmt: skip
    said = " ".join(refused.stderr.split())
    assert refused.returncode != 0 and f"chmod 600 {token}" in said, said
    assert "_file" not in said and "shared-agent-token-of-the-test" not in said
