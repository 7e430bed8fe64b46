"""A model at zero replicas starts while the store is down (issue 57: 3 of 3 requests got 503
after 20 s, although the README said requests are served all along). The leader, its lease
unrenewable, stands in: it starts one replica on the node the model ran on last, without a
store write, answers its agents and pushes the table; the held request is served, and the
count is stored once the store is back."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import httpx
import psutil

from .conftest import Operator, fleet_of, wait_for

MODEL = {
    "name": "m",
    "engine": "sim",
    "args": ["--ttft", "0.01", "--itl", "0.01", "--startup-delay", "0.5"],
    "autoscale": {"min": 0, "max": 1, "target_in_flight": 2, "scale_up_after": "0.5s",
                  "scale_down_after": "2s", "scale_to_zero_after": "2s"},
    "cold_timeout": "25s",
}  # fmt: skip


def test_a_cold_model_starts_where_it_ran_last_while_the_store_is_down() -> None:
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-cold-"))
    os.chmod(folder, 0o711)  # run as root, the server runs as `postgres`, which must enter
    try:
        with fleet_of(folder, [MODEL], store="postgres", control_plane={"lease_ttl": 1.5}) as fleet:
            op = Operator(fleet, folder)
            wait_for("the cold model in the routing table", lambda: op.routed("m") == [], 60)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}  # fmt: skip
            headers = {"authorization": f"Bearer {fleet.api_key}"}

            def ask() -> httpx.Response:
                return httpx.post(f"{fleet.router_url}/v1/chat/completions", json=body,
                                  headers=headers, timeout=60)  # fmt: skip

            first = ask()
            assert first.status_code == 200, first.text
            [ran] = wait_for("a replica of m", lambda: op.replicas("m") or None, 30)
            wait_for("m back at zero replicas", lambda: op.replicas("m") == [], 60)

            [pidfile] = folder.rglob("postmaster.pid")
            postmaster = psutil.Process(int(pidfile.read_text().split()[0]))
            server = [postmaster, *postmaster.children(recursive=True)]
            for p in server:  # the server and every session of it
                os.kill(p.pid, signal.SIGSTOP)
            try:
                wait_for("the leader no longer acting", lambda: not op.get("/v1/status")[
                    "leading"], 30)  # fmt: skip
                held = ask()
                assert held.status_code == 200, held.text
                [started] = op.replicas("m")
                nodes = [s["node"] for s in started["shards"]]
                assert nodes == [s["node"] for s in ran["shards"]]  # where it ran last
            finally:
                for p in server:
                    os.kill(p.pid, signal.SIGCONT)
            wait_for("the leader acting again", lambda: op.get("/v1/status")["leading"], 60)

            def told() -> bool:
                events = op.get("/v1/events?limit=200")["events"]
                return any(
                    e["reason"] == "ReplicasScaled" and "while the store is down" in e["message"]
                    for e in events
                )

            wait_for("the start while the store was down, recorded", told, 30)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
