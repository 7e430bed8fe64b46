"""LoRA adapters on a real fleet (control plane, agent, router, simulator): loaded into the
engine the control plane chose, routed to where they are loaded, a failed load shown with the
engine's words, loaded again after the engine restarts, and swapped live by a catalog change."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from .conftest import Operator, fleet_of, wait_for


def _ask(op: Operator, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return op.client.post("/v1/chat/completions", json=body, timeout=30)


def _adapters(op: Operator, model: str) -> dict[str, dict[str, Any]]:
    [replica] = op.replicas(model)
    return {a["name"]: a for a in replica["shards"][0]["adapters"]}


def test_adapters_are_loaded_routed_reported_reloaded_and_swapped_live(tmp_path: Path) -> None:
    weights = tmp_path / "sql-lora"
    weights.mkdir()
    base = {
        "name": "base",
        "engine": "sim",
        "args": ["--lora-load-delay", "0.2"],
        "max_loras": 3,
        "adapters": [
            {"name": "sql", "source": str(weights)},
            {"name": "chat", "source": "org/chat-lora"},  # a name the engine resolves
            {"name": "broken", "source": str(tmp_path / "missing")},
        ],
    }
    with fleet_of(tmp_path, [base]) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("sql and chat loaded", lambda: op.serves("sql") and op.serves("chat"))
        answer = _ask(op, "base:chat")  # the alias names the same adapter
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "chat"

        listed = {m["id"]: m.get("parent") for m in op.client.get("/v1/models").json()["data"]}
        assert listed == {"base": None, "sql": "base", "chat": "base", "broken": "base"}

        # The missing source: tried, then failed with the engine's own words, shown by ctl.
        failed = wait_for(
            "broken reported failed",
            lambda: (a := _adapters(op, "base").get("broken")) and a["state"] == "failed" and a,
            timeout=30,
        )
        assert "No adapter found" in failed["error"] and failed["tries"] == 5
        [replica] = op.replicas("base")
        shown = op.ctl("replicas", "show", replica["id"]).stdout
        assert "broken" in shown and "failed" in shown and "No adapter found" in shown
        # Loaded nowhere, a request for it is refused at once with the engine's words.
        refused = _ask(op, "broken")
        assert refused.status_code == 503, refused.text
        assert refused.headers["x-modelfleet-reason"] == "adapter-failed"
        assert "No adapter found" in refused.json()["error"]["message"]

        # The engine dies: the agent starts it again and loads both adapters into it again,
        # and no request for them is sent there before.
        engine = replica["shards"][0]["pid"]
        os.kill(engine, signal.SIGKILL)
        wait_for(
            "a new engine",
            lambda: (r := op.replicas("base")) and r[0]["shards"][0]["pid"] not in (None, engine),
        )
        ready = wait_for(
            "the new engine ready",
            lambda: op.replicas("base")[0]["state"] == "ready" and time.monotonic(),
        )
        wait_for(
            "sql and chat loaded again",
            lambda: all(_adapters(op, "base")[n]["state"] == "loaded" for n in ("sql", "chat")),
        )
        reloaded_s = time.monotonic() - ready
        assert _ask(op, "sql").status_code == 200
        print(f"adapters loaded again {reloaded_s:.2f}s after the engine was seen ready")

        # A catalog change swaps adapters live: chat goes, poem comes; the engine stays.
        pid = op.replicas("base")[0]["shards"][0]["pid"]
        swapped = {**base, "adapters": [base["adapters"][0], {"name": "poem", "source": "p"}]}
        path = tmp_path / "swapped.yaml"
        path.write_text(yaml.safe_dump({"models": [swapped]}))
        dry = op.ctl("catalog", "apply", str(path), "--dry-run").stdout
        assert "no replica starts or stops" in dry, dry
        row = next(line for line in dry.splitlines() if replica["id"] in line)
        assert "poem" in row and "chat" in row and "sql" not in row, dry  # loads, unloads
        assert "broken" in row  # what it was told to hold, failed or not
        op.apply(swapped)
        wait_for("poem served", lambda: op.serves("poem"))
        wait_for("chat gone", lambda: _ask(op, "chat").status_code == 404)
        assert set(_adapters(op, "base")) == {"sql", "poem"}
        assert op.replicas("base")[0]["shards"][0]["pid"] == pid

        # Each adapter counted as a model of its own: the router's metrics and `ctl usage`.
        page = op.router_metrics()
        assert 'modelfleet_router_requests_total{model="sql",status="200"}' in page
        assert 'modelfleet_router_first_byte_seconds_count{model="chat"}' in page
        assert 'modelfleet_router_tokens_total{kind="completion",model="sql"}' in page
        usage = wait_for(
            "the adapters' usage collected",
            lambda: "poem" in (u := op.ctl("usage", "-o", "csv").stdout) and u,
        )
        rows = [line.split(",") for line in usage.splitlines()]
        # The 404 for `chat` once it was gone is counted under "-": a name the table does not
        # know makes no usage row of its own.
        assert {r[2] for r in rows[1:]} == {"sql", "chat", "poem", "broken", "-"}, usage


def test_a_request_for_an_adapter_no_replica_holds_waits_while_the_control_plane_loads_it(
    tmp_path: Path,
) -> None:
    base = {
        "name": "small",
        "engine": "sim",
        "args": ["--lora-load-delay", "0.3"],
        "max_loras": 1,
        "adapters": [{"name": "first", "source": "a"}, {"name": "second", "source": "b"}],
    }
    with fleet_of(tmp_path, [base]) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("first loaded (the only slot)", lambda: op.serves("first"))
        assert set(_adapters(op, "small")) == {"first"}
        # second is held by the router, which tells the control plane; it takes first's slot.
        began = time.monotonic()
        answer = _ask(op, "second")
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - began >= 0.3  # it waited for the load
        assert set(_adapters(op, "small")) == {"second"}


def test_a_request_for_an_adapter_of_a_model_at_zero_replicas_starts_one(tmp_path: Path) -> None:
    base = {
        "name": "idle",
        "engine": "sim",
        "args": ["--lora-load-delay", "0.2", "--startup-delay", "0.5"],
        "max_loras": 1,
        "adapters": [{"name": "tuned", "source": "t"}],
        "autoscale": {"min": 0, "max": 1, "target_in_flight": 2, "scale_up_after": "0.5s",
                      "scale_down_after": "60s", "scale_to_zero_after": "60s"},
        "cold_timeout": "60s",
    }  # fmt: skip
    with fleet_of(tmp_path, [base]) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for(
            "tuned in the router's models",
            lambda: "tuned" in [m["id"] for m in op.client.get("/v1/models").json()["data"]],
        )
        assert op.replicas("idle") == []
        # Held as the adapter's request, it is the model's load too: a replica starts, the
        # adapter is loaded into it, and the request is answered by it.
        answer = _ask(op, "tuned")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "tuned"
        assert len(op.replicas("idle")) == 1
        assert _adapters(op, "idle")["tuned"]["state"] == "loaded"


def test_a_key_names_an_adapter_and_the_dashboard_shows_what_each_replica_holds(
    tmp_path: Path,
) -> None:
    """Issue 57: `keys create --models ADAPTER` was refused though keys name adapters like
    models, and adapters appeared nowhere on the dashboard."""
    base = {
        "name": "base",
        "engine": "sim",
        "args": ["--lora-load-delay", "0.1"],
        "adapters": [{"name": "sql", "source": "org/sql-lora"}],
    }
    with fleet_of(tmp_path, [base]) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("sql loaded", lambda: op.serves("sql"))
        key = op.ctl("keys", "create", "for-sql", "--models", "sql", "-q").stdout.strip()
        aliased = op.ctl("keys", "create", "by-alias", "--models", "base:sql", "-q").stdout
        refused = op.ctl("keys", "create", "nope", "--models", "sqll", check=False)
        assert refused.returncode != 0 and "sqll" in refused.stderr + refused.stdout
        assert "sql" in refused.stderr + refused.stdout  # what the catalog has, adapters too
        stored = {k["name"]: k["models"] for k in op.get("/v1/keys")["keys"]}
        assert stored["for-sql"] == stored["by-alias"] == ["sql"]  # the router's name for it
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        for secret in (key, aliased.strip()):
            client = httpx.Client(
                base_url=fleet.router_url, headers={"authorization": f"Bearer {secret}"}
            )

            def asked(model: str, client: httpx.Client = client) -> int:
                return client.post(
                    "/v1/chat/completions", json={**body, "model": model}, timeout=30
                ).status_code

            # Once the routers hold the new key, the adapter is served, either way it is
            # named; its base is not this key's.
            wait_for("the key reaches the router", lambda asked=asked: asked("sql") == 200)
            assert asked("base:sql") == 200 and asked("base") == 404
            ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert ids == ["sql"]

        ui = httpx.Client(base_url=fleet.admin_url, timeout=10)
        ui.post("/ui/login", data={"token": fleet.admin_token})
        [replica] = op.replicas("base")
        page = ui.get(f"/ui/replicas/{replica['id']}").text
        assert 'data-adapter="sql"' in page and "loaded" in page
        assert "adapters: sql" in ui.get("/ui/models/base").text
        # Its use, by hour, key and model: the adapter with its base.
        row = re.compile(
            r"<td>for-sql</td><td>sql <span class=\"hint\">\(adapter of base\)</span></td><td>[1-9]"
        )
        wait_for(
            "the adapter's use counted", lambda: row.search(ui.get("/ui/usage").text), timeout=30
        )
