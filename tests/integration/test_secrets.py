"""Secrets that stay secret, with real processes: engines nobody reaches around the router,
and no token or key in any log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from modelfleet.agent.records import read_records

from .conftest import Operator, fleet_of, wait_for


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
