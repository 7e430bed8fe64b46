"""What `ctl` and the router say of a model that cannot serve, with real processes: a
crash-looping engine is followed by `ctl logs -f` across its restarts, shown failed with its
last error by `ctl replicas` and counted by `ctl status`; the router answers a model that
cannot serve (crash-looping, or placeable nowhere, held or not) 503 with why, and no
Retry-After."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelfleet.up import RunningFleet

from .conftest import Operator, ctl_target, fleet_of, wait_for

# An engine that says which run it is (its pid) and exits before it is ever ready.
LOOP = {
    "name": "loop",
    "engine": "command",
    "command": "sh -c 'echo run-$$ begins; sleep 0.2; echo run-$$ gives up >&2; exit 3'",
}
NOWHERE = {"name": "nowhere", "engine": "sim", "gpu_model": "B200"}  # no node has one
COLD_NOWHERE = {
    "name": "cold-nowhere",
    "engine": "sim",
    "gpu_model": "B200",
    "autoscale": {"max": 1, "target_in_flight": 1},
    "cold_timeout": 300,  # held this long, were it not said that none is coming
}


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    with fleet_of(
        tmp_path_factory.mktemp("looping"),
        [LOOP, NOWHERE, COLD_NOWHERE],
        agent_args=("--backoff-base", "0.5", "--backoff-max", "1"),
        control_plane={"max_failures": 1000},  # kept where it is, failing
    ) as fleet:
        yield fleet


def ask(op: Operator, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return op.client.post("/v1/chat/completions", json=body, timeout=60)


def test_ctl_logs_follow_goes_on_across_an_engine_s_restarts(
    looping: RunningFleet, tmp_path: Path
) -> None:
    """`ctl logs -f` follows the shard, not the file: each run's output, restarts included
    (it printed the first run's and then nothing: the new run's file was never longer than
    where the first one ended)."""
    op = Operator(looping, tmp_path)
    replica = wait_for("the loop's replica", lambda: op.replicas("loop"))[0]
    follow = subprocess.Popen(
        [sys.executable, "-m", "modelfleet", "ctl", "logs", "-f", replica["id"],
         *ctl_target(looping)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    runs: set[str] = set()
    said: list[str] = []

    def read() -> None:
        assert follow.stdout is not None
        for line in follow.stdout:
            said.append(line)
            runs.update(re.findall(r"run-(\d+) gives up", line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for("three runs' last words from one `ctl logs -f`", lambda: len(runs) >= 3)
    finally:
        follow.kill()
        follow.wait()
        reader.join(5)
    begun = {m for line in said for m in re.findall(r"run-(\d+) begins", line)}
    assert runs <= begun  # each run whole, from its first line


def test_a_crash_loop_is_shown_failed_with_its_last_error_and_counted(
    looping: RunningFleet, tmp_path: Path
) -> None:
    """`ctl replicas` showed a crash-looping replica `starting` with no error, and `ctl
    status` counted no failure: it is failed, with the last error, also while the next start
    is under way."""
    op = Operator(looping, tmp_path)

    def failed() -> dict[str, Any] | None:
        found = [r for r in op.replicas("loop") if r["state"] == "failed"]
        return next((r for r in found if r["shards"][0]["state"] == "starting"), None)

    seen = wait_for("the loop shown failed while it starts again", failed)
    assert "exit" in seen["error"] and "failure(s) in a row" in seen["error"], seen
    table = op.ctl("replicas").stdout
    [row] = [line for line in table.splitlines() if seen["id"] in line]
    assert re.search(r"\bfailed\b.*engine exited \(3\)", row), table
    status = op.ctl("status").stdout
    assert "(1 failed)" in status, status  # the status counted none


def test_the_router_answers_a_model_that_cannot_serve_with_why_and_no_retry_after(
    looping: RunningFleet, tmp_path: Path
) -> None:
    """It said "try again shortly" with `Retry-After: 1` for a model that could never serve
    (placeable nowhere, or its engine always failing), and held an autoscaled one's requests
    for its whole cold_timeout."""
    op = Operator(looping, tmp_path)

    def refused(model: str, why: str) -> httpx.Response | None:
        r = ask(op, model)
        return (
            r if r.headers.get("x-modelfleet-reason") == "cannot-serve" and why in r.text else None
        )

    for model, why in (("loop", "failing"), ("nowhere", "cannot be placed"),
                       ("cold-nowhere", "cannot be placed")):  # fmt: skip
        answer = wait_for(f"{model} refused with why", lambda m=model, w=why: refused(m, w))
        assert answer.status_code == 503 and "retry-after" not in answer.headers, answer.text
        assert "cannot serve now" in answer.json()["error"]["message"]
    assert "B200" in ask(op, "nowhere").text  # the placement's reason, from the control plane
