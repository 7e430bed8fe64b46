"""The README's "Across machines", run as written on three hosts: network namespaces joined by
a bridge (`modelfleet.host.hosts`). Host A runs the control plane and a router, B and C an agent
each with simulated GPUs; the official openai client is served through the router over TLS
all along, while C is added and B removed. Skipped, saying why, where network namespaces
cannot be made (not root); CI runs as root.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.hosts import Capture, Hosts, Shell, netns_unavailable, shell_blocks
from modelfleet.host.processes import stop_groups

from .conftest import wait_for
from .openai_client import outcomes

README = Path(__file__).parents[2] / "README.md"
ADDRESSES = {"a": "10.10.0.1", "b": "10.10.0.2", "c": "10.10.0.3"}
CLIENT = Path(__file__).with_name("openai_client.py")
ROUTER = "https://10.10.0.1:8080/v1"


def readme_blocks() -> list[str]:
    """The shell blocks of the README's "Across machines", in order."""
    return shell_blocks(README.read_text(), "Across machines")


def test_the_readme_names_each_block_for_its_host() -> None:
    heads = [block.splitlines()[0] for block in readme_blocks()]
    assert heads == [
        "# On host A, in a folder of its own:",
        "# On each GPU host, with NODE its name and TOKEN the join token:",
        "# On host A:",
        "# On host A:",
        "# On host A, with NODE the host to remove:",
    ]


def join_token(printed: str) -> str:
    found = re.findall(r"token: (mfjoin\.\S+)", printed)
    assert len(found) == 1, printed[-2000:]
    return str(found[0])


class Fleet:
    """The shells of the three hosts and what the test reads from them."""

    def __init__(self, net: Hosts, folder: Path) -> None:
        self.net, self.folder = net, folder
        self.shells: dict[str, Shell] = {}
        self.agent_dirs: list[Path] = []

    def shell(self, host: str, **env: str) -> Shell:
        made = Shell(self.net.netns(host), self.folder / host, env)
        self.shells[host] = made
        return made

    def in_host(self, host: str, *args: str, timeout: float = 60) -> str:
        """A command of the test's own on `host` (not the README's), its output."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.net.netns(host), *args],
            capture_output=True, text=True, timeout=timeout, cwd=self.folder / host,
        )  # fmt: skip
        assert done.returncode == 0, f"{args}: {done.stdout[-1000:]} {done.stderr[-2000:]}"
        return done.stdout

    def replicas(self) -> list[dict[str, Any]]:
        shown = self.shells["a"].run("modelfleet ctl -o json replicas", timeout=60)
        return list(json.loads(shown[shown.index("{") :])["replicas"])

    def serving_on(self, node: str) -> int:
        return sum(
            1 for r in self.replicas() if r["state"] == "ready" and r["shards"][0]["node"] == node
        )

    def end(self) -> None:
        """End every shell (and the services it started), then the engines the agents left
        running (engines outlive their agents by design)."""
        for shell in self.shells.values():
            shell.end()
        for folder in self.agent_dirs:
            stop_groups(recorded_engine_pids(folder), grace=10)


def test_a_fleet_across_three_hosts_as_the_readme_says(tmp_path: Path) -> None:
    setup, agent, use, add, remove = readme_blocks()
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    with Hosts(ADDRESSES) as net:
        fleet = Fleet(net, tmp_path)
        try:
            run_the_readme(fleet, setup, agent, use, add, remove)
        finally:
            fleet.end()
            left = [p for s in fleet.shells.values() for p in s.members()]
            assert left == [], f"processes left behind: {left}"


def run_the_readme(fleet: Fleet, setup: str, agent: str, use: str, add: str, remove: str) -> None:
    a = fleet.shell("a")
    token = join_token(a.run(setup, timeout=120))
    key = a.run('echo "KEY=$KEY"').strip().splitlines()[-1].removeprefix("KEY=")
    assert key.startswith("mf-")

    # The files that hold tokens are their owner's alone (a service refuses them otherwise).
    modes = fleet.in_host("a", "stat", "-c", "%a %n", "control-plane.yaml", "router.yaml")
    assert modes.split() == ["600", "control-plane.yaml", "600", "router.yaml"], modes

    fleet.agent_dirs.append(tmp_agent_dir(fleet, "b", "gpu-1"))
    fleet.shell("b", NODE="gpu-1", TOKEN=token).run(agent)
    wait_for("both replicas to serve on gpu-1", lambda: fleet.serving_on("gpu-1") == 2, 90, 0.5)
    # The join token is on no command line, for `ps` to show.
    assert token not in fleet.in_host("b", "ps", "-eo", "args")
    ca = str(fleet.folder / "a" / "state" / "pki" / "ca.crt")
    wire = Capture(fleet.net.netns("b"), fleet.folder / "b.pcap")  # the GPU host's network
    try:
        used = a.run(use)
        assert '"choices"' in used, used[-2000:]
        answer = fleet.in_host("a", sys.executable, str(CLIENT), ROUTER, ca, key, "chat", "once")
        assert answer.strip(), "the openai client got an empty answer"
    finally:
        crossed = wire.stop()
    # The router reached gpu-1's engines over TLS (their node's name is in the handshake) and
    # the prompt ("Hello") and the engines' keys never crossed in clear.
    assert b"Hello" not in crossed and b"mfe-" not in crossed
    assert b"gpu-1.node.modelfleet.invalid" in crossed

    # Another host, holding no router certificate, gets no answer from an engine on any path
    # real vLLM serves, with TLS or without.
    endpoints = [r["endpoint"] for r in fleet.replicas() if r["state"] == "ready"]
    assert endpoints and all(e.startswith("https://10.10.0.2:") for e in endpoints), endpoints
    (fleet.folder / "c").mkdir(exist_ok=True)
    tried = fleet.in_host("c", "sh", "-c", stranger_requests(endpoints[0]), timeout=120)
    assert tried.split() == ["refused"] * 2 * len(VLLM_PATHS), tried

    # Requests all along while a host is added and another removed: none may fail.
    stop, out = fleet.folder / "stop-load", fleet.folder / "load.jsonl"
    load = subprocess.Popen(
        ["ip", "netns", "exec", fleet.net.netns("a"), sys.executable, str(CLIENT), ROUTER, ca,
         key, "chat", "load", "10", str(stop), str(out)],
        start_new_session=True,
    )  # fmt: skip
    try:
        second = join_token(a.run(add))
        fleet.agent_dirs.append(tmp_agent_dir(fleet, "c", "gpu-2"))
        fleet.shell("c", NODE="gpu-2", TOKEN=second).run(agent)
        nodes_ready = "modelfleet ctl -o json nodes | grep -c '\"ready\": true'"
        wait_for("gpu-2 to join", lambda: a.type(nodes_ready, 30).strip().endswith("2"), 60, 0.5)

        a.run("NODE=gpu-1")
        removed = a.run(remove, timeout=180)
        assert "node gpu-1 revoked" in removed and "node gpu-1 deleted" in removed, removed
        fleet.shells["b"].end()
        assert fleet.serving_on("gpu-2") == 2
        nodes = a.run("modelfleet ctl -o json nodes")
        assert '"gpu-1"' not in nodes
    finally:
        stop.touch()
        load.wait(timeout=60)
    done = outcomes(out)
    failed = [o for o in done if o["error"]]
    assert len(done) > 20 and failed == [], failed
    served_by = {o["replica"] for o in done}
    assert len(served_by) >= 3, served_by  # gpu-1's replicas, then their replacements


# Every path real vLLM 0.32 serves; it checks its key on /v1 paths only.
VLLM_PATHS = ["/invocations", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize",
              "/classify", "/health", "/metrics", "/version", "/ping", "/v1/chat/completions",
              "/v1/completions", "/v1/models"]  # fmt: skip


def stranger_requests(endpoint: str) -> str:
    """A shell script that POSTs a chat request with no key to every path of `endpoint`, by
    https and by plain http, and prints `refused` for each that got no HTTP answer at all."""
    port = endpoint.rsplit(":", 1)[1]
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    lines = []
    for path in VLLM_PATHS:
        for scheme, flags in (("https", "-k"), ("http", "")):
            url = f"{scheme}://10.10.0.2:{port}{path}"
            lines.append(
                f"code=$(curl -s {flags} -o /dev/null -w '%{{http_code}}' --max-time 10 "
                f"-H 'content-type: application/json' -d '{body}' {url}); "
                f'if [ "$code" = 000 ]; then echo refused; else echo "{url}:$code"; fi'
            )
    return "\n".join(lines)


def tmp_agent_dir(fleet: Fleet, host: str, node: str) -> Path:
    """Where the README's agent command keeps its state, on `host` in its folder."""
    return fleet.folder / host / ".modelfleet" / "agents" / node
