"""A control plane that serves TLS with its own CA, and the agents, ctl and routers that check
it: real processes on 127.0.0.1 (`tls: on` and the router's certificate ask for TLS on
loopback too)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.processes import free_port, stop_groups
from modelfleet.security.pki import client_context

from .conftest import Procs, wait_for, wait_json

ADMIN_TOKEN = "admin-token-of-the-test"
AGENT_TOKEN = "agent-token-of-the-test"


def _ctl(admin: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
    return subprocess.run(
        [sys.executable, "-m", "modelfleet", "ctl", "--admin", admin, "--token", ADMIN_TOKEN,
         *args],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip


def _serve(
    procs: Procs, folder: Path, role: str, config: dict[str, Any], run: str
) -> dict[str, Any]:
    """Write `config` as ROLE's config file in `folder`, start `modelfleet ROLE`, and return
    its ready file (with its `pid`) once it listens."""
    config_file, ready = folder / f"{role}.yaml", folder / f"{run}.json"
    config_file.write_text(yaml.safe_dump(config))
    started = procs.start(role, "--config", str(config_file), "--ready-file", str(ready), log=run)
    found = wait_json(ready, started)
    found["pid"] = started.pid
    return found


def test_a_control_plane_serves_tls_with_a_ca_of_its_own_that_agents_and_ctl_check(
    procs: Procs, tmp_path: Path
) -> None:
    config = {
        "state_dir": "state", "admin_token": ADMIN_TOKEN, "agent_token": AGENT_TOKEN,
        "tls": "on", "agent_port": 0, "admin_port": 0, "heartbeat_interval": 0.5,
    }  # fmt: skip
    first = _serve(procs, tmp_path, "control-plane", config, "cp-1")
    agent_url, admin_url = first["urls"]["agent"], first["urls"]["admin"]
    assert agent_url.startswith("https://127.0.0.1:") and admin_url.startswith("https://127.0.0.1:")
    ca_file = Path(first["ca_file"])
    assert ca_file == tmp_path / "state" / "pki" / "ca.crt"
    assert stat.S_IMODE((ca_file.parent / "ca.key").stat().st_mode) == 0o600

    # Plain HTTP gets no answer; a client that checks the certificate against the CA does.
    with pytest.raises(httpx.TransportError):
        httpx.get(admin_url.replace("https://", "http://") + "/v1/status", timeout=5)
    refused = _ctl(admin_url, "status")
    assert refused.returncode == 1, refused.stderr
    assert "serves TLS: give ctl the control plane's CA" in refused.stderr
    assert _ctl(admin_url, "--ca", str(ca_file), "status").returncode == 0

    agent_args = [
        "agent", "--control-plane", agent_url, "--node", "n1", "--simulate-gpus", "1x80GB",
        "--token", AGENT_TOKEN, "--state-dir", str(tmp_path / "agent"),
    ]  # fmt: skip
    unverified = subprocess.run(
        [sys.executable, "-m", "modelfleet", *agent_args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert unverified.returncode == 2 and "give --ca FILE" in unverified.stderr
    procs.start(*agent_args, "--ca", str(ca_file), log="agent")

    def heard_n1() -> bool:
        shown = _ctl(admin_url, "--ca", str(ca_file), "-o", "json", "nodes")
        assert shown.returncode == 0, shown.stderr
        return any(n["name"] == "n1" and n["ready"] for n in json.loads(shown.stdout)["nodes"])

    wait_for("node n1 to report over TLS", heard_n1)

    # A restarted control plane keeps its CA: what trusts it goes on trusting it.
    stop_groups([first["pid"]], grace=20)
    second = _serve(procs, tmp_path, "control-plane", config, "cp-2")
    assert second["ca_fingerprint"] == first["ca_fingerprint"]
    assert _ctl(second["urls"]["admin"], "--ca", str(ca_file), "status").returncode == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_fleet_over_tls_serves_the_openai_client_and_its_pushes_are_checked(
    procs: Procs, tmp_path: Path, workers: int
) -> None:
    """Control plane, agent and router on TLS (on loopback, asked for): the router's
    certificate comes from the fleet's CA (`modelfleet certificate`), the control plane
    pushes its table to the router's push API checking it against that CA, and the official
    openai client gets a completion through the router, trusting that CA alone. With two
    workers, each serves TLS on the client port and the parent the push API."""
    push_token = "push-token-of-the-test"
    port, push_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    (tmp_path / "catalog.yaml").write_text(
        yaml.safe_dump({"models": [{"name": "m", "engine": "sim", "replicas": 1}]})
    )
    config = {
        "catalog": "catalog.yaml", "state_dir": "state", "admin_token": ADMIN_TOKEN,
        "agent_token": AGENT_TOKEN, "tls": "on", "agent_port": 0, "admin_port": 0,
        "routers": [{"url": f"https://127.0.0.1:{push_port}", "token": push_token}],
    }  # fmt: skip
    found = _serve(procs, tmp_path, "control-plane", config, "cp")
    ca_file = Path(found["ca_file"])

    issued = subprocess.run(
        [sys.executable, "-m", "modelfleet", "certificate", "--state-dir", str(tmp_path / "state"),
         "--name", "127.0.0.1", "--out", str(tmp_path / "tls"), "--stem", "router"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert issued.returncode == 0, issued.stderr
    assert found["ca_fingerprint"] in issued.stdout
    router_config = {
        "port": port, "push_port": push_port, "push_token": push_token,
        "tls_cert": str(tmp_path / "tls" / "router.crt"),
        "tls_key": str(tmp_path / "tls" / "router.key"),
        "api_keys": [{"name": "app", "key": "sk-app-key-of-the-test"}], "workers": workers,
    }  # fmt: skip
    urls = _serve(procs, tmp_path, "router", router_config, "router")["urls"]
    assert urls == {"router": f"https://127.0.0.1:{port}", "push": f"https://127.0.0.1:{push_port}"}
    procs.start(
        "agent", "--control-plane", found["urls"]["agent"], "--node", "n1", "--simulate-gpus",
        "1x80GB", "--token", AGENT_TOKEN, "--ca", str(ca_file), "--state-dir",
        str(tmp_path / "agent"), log="agent",
    )  # fmt: skip
    try:
        _complete_over_tls(urls["router"], ca_file)
    finally:
        # Engines outlive their agent by design: once it has stopped (and recorded them),
        # the engines it started are ended too, by their process groups.
        procs.stop_all()
        stop_groups(recorded_engine_pids(tmp_path / "agent"), grace=10)


def _complete_over_tls(router_url: str, ca_file: Path) -> None:
    """The openai client gets a completion through the router, trusting the fleet's CA
    alone (retried until the table is pushed and the replica ready); a client trusting the
    system's CAs is refused."""
    with httpx.Client(verify=client_context(ca_file.read_bytes()), timeout=20) as http:
        client = openai.OpenAI(
            base_url=router_url + "/v1",
            api_key="sk-app-key-of-the-test",
            http_client=http,
            max_retries=0,
        )

        def answered() -> str | None:
            try:
                done = client.completions.create(model="m", prompt="hello", max_tokens=4)
            except (openai.NotFoundError, openai.APIStatusError):
                return None  # not pushed yet, or no replica ready yet
            return done.choices[0].text

        assert wait_for("a completion through the router over TLS", answered, timeout=60)
    # Each on a new connection: with several workers the kernel spreads them over all.
    verify = client_context(ca_file.read_bytes())
    for _ in range(10):
        assert httpx.get(router_url + "/health", verify=verify, timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(router_url + "/health", timeout=5)  # the system's CAs know it not
