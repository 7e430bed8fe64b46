"""A fleet across three hosts, under load, through a partition, a group restart and an
impersonation: network namespaces on one machine (`modelfleet.host.hosts`; needs root).

Host A (10.10.0.1) runs the control plane and a router, hosts B and C an agent each with two
simulated GPUs, set up by typing the README's "Across machines" commands, as the multi-host
test does. The official openai client sends chat completions through the router over TLS
from host A, each on time whether the one before ended or not (`--rate`, 10/s by default; 5/s
more to the 2-shard model of the group scenario: under 20/s in all). Then, one after another:

- tls: each listener host B reaches (control plane's agent and admin APIs, the router's
  client and push APIs) refuses plain HTTP and answers TLS checked against the fleet's CA;
- impersonation: a report sent with B's credential naming C is refused (403);
- partition: C's link is cut; its replica of `chat` serves on B once C is lost
  (node_lost_after, 60 s by default); the link comes back and C's agent stops what it no
  longer holds;
- group: `chat` goes to one replica and a model `wide` of two shards (one on B, one on C)
  comes; its rank 1 engine is killed; all its shards restart together.

    sudo python bench/multihost.py [--rate 10]

It ends with one JSON line: tls, join_s (an agent started with a token until its node has
reported), requests, failed (outside the partition and group scenarios), partition_replaced_s
(cut until C's replica serves on B), partition_failed, partition_failed_late (failed requests
that started after the cut: the target is that only those in flight on C at the cut fail),
heal_duplicates_left (replicas beyond the catalog's, and engines left on C, once C is back),
group_restart_s (rank 1 killed until the replica serves again), group_failed,
impersonation_refused, engine_tls (every replica's endpoint was https, behind its node's
gate, and no HTTP request line crossed hosts B and C in clear: tcpdump on both all along) and
plaintext_prompt_seen (the clients' prompt in those captures).

Targets: failed 0, partition_failed_late 0, heal_duplicates_left 0, group_restart_s <= 15,
join_s <= 5, impersonation_refused true, tls true, engine_tls true, plaintext_prompt_seen
false.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kit import end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.hosts import Capture, Hosts, Shell, call_in, netns_unavailable, shell_blocks
from modelfleet.host.processes import running, stop_groups
from modelfleet.messages.wire import AgentReport
from modelfleet.security.pki import client_context

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "integration" / "openai_client.py"
ADDRESSES = {"a": "10.10.0.1", "b": "10.10.0.2", "c": "10.10.0.3"}
NODES = {"b": "gpu-1", "c": "gpu-2"}
ROUTER = "https://10.10.0.1:8080/v1"
LISTENERS = {
    "control plane agent API": "https://10.10.0.1:7070/v1/join/ca",
    "control plane admin API": "https://10.10.0.1:7071/v1/status",
    "router client API": "https://10.10.0.1:8080/health",
    "router push API": "https://10.10.0.1:8081/v1/routing/held",
}
PROMPT = b"Hello"  # what the openai client asks (tests/integration/openai_client.py)
GROUP_CATALOG = """models:
  - {name: chat, engine: sim, replicas: 1}
  - {name: wide, engine: sim, shards: 2}
"""


def wait(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    return _wait(what, check, timeout, every=every)


class Bench:
    """The three hosts, their shells, and the control plane's admin API seen from host A."""

    def __init__(self, net: Hosts, folder: Path) -> None:
        self.net, self.folder = net, folder
        self.shells: dict[str, Shell] = {}
        self.loads: list[subprocess.Popen[bytes]] = []
        self.admin_token = ""
        self.key = ""
        self.captures: dict[str, Capture] = {}
        self.endpoints: set[str] = set()  # every endpoint a replica was shown at
        self.ca = folder / "a" / "state" / "pki" / "ca.crt"

    def shell(self, host: str, **env: str) -> Shell:
        made = Shell(self.net.netns(host), self.folder / host, env)
        self.shells[host] = made
        return made

    def admin(self, path: str) -> Any:
        """GET the admin API from host A."""

        def get() -> Any:
            answer = httpx.get(
                "https://10.10.0.1:7071" + path,
                headers={"authorization": f"Bearer {self.admin_token}"},
                verify=client_context(self.ca.read_bytes()),
                timeout=10,
            )
            answer.raise_for_status()
            return answer.json()

        return call_in(self.net.netns("a"), get)

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.admin("/v1/replicas")["replicas"] if r["model"] == model]

    def ready(self, model: str) -> list[dict[str, Any]]:
        ready = [r for r in self.replicas(model) if r["state"] == "ready"]
        self.endpoints.update(r["endpoint"] for r in ready)
        return ready

    def load(self, model: str, rate: float, name: str) -> tuple[Path, Path]:
        """Start the openai client on host A sending `rate` requests/s to `model`."""
        stop, out = self.folder / f"stop-{name}", self.folder / f"{name}.jsonl"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.net.netns("a"), sys.executable, str(CLIENT), ROUTER,
             str(self.ca), self.key, model, "load", str(rate), str(stop), str(out)],
            start_new_session=True,
        )  # fmt: skip
        self.loads.append(proc)
        return stop, out

    def end(self) -> None:
        for stop in self.folder.glob("stop-*"):
            stop.touch()
        for path in self.folder.glob("*.jsonl"):
            (self.folder / f"stop-{path.stem}").touch()
        stop_groups([p.pid for p in self.loads], grace=40)
        for capture in self.captures.values():
            capture.stop()
        for shell in self.shells.values():
            shell.end()
        for host, node in NODES.items():
            stop_groups(recorded_engine_pids(self.agent_dir(host, node)), grace=10)

    def agent_dir(self, host: str, node: str) -> Path:
        return self.folder / host / ".modelfleet" / "agents" / node

    def run(self, rate: float) -> dict[str, Any]:
        setup, agent, *_ = shell_blocks((ROOT / "README.md").read_text(), "Across machines")
        a = self.shell("a")
        printed = a.run(setup, timeout=120)
        [token] = re.findall(r"token: (mfjoin\.\S+)", printed)
        env = a.run('echo "$MODELFLEET_ADMIN_TOKEN $KEY"').split()
        self.admin_token, self.key = env[-2], env[-1]

        join_s = 0.0
        for host in NODES:
            self.captures[host] = Capture(self.net.netns(host), self.folder / f"{host}.pcap")
        for host, node in NODES.items():
            began = time.monotonic()
            self.shell(host, NODE=node, TOKEN=token).run(agent)
            wait(f"{node} to report", functools.partial(self._has_node, node), 30, 0.05)
            join_s = max(join_s, time.monotonic() - began)
        print(f"join: {join_s:.2f}s from the agent's start to its node's first report")
        wait("both replicas of chat to serve", lambda: len(self.ready("chat")) == 2, 90)

        chat_stop, chat_out = self.load("chat", rate, "chat")
        wait("the load to run", lambda: _count(chat_out) >= 5 * rate, 60)
        tls = self.check_tls()
        refused = self.impersonate()

        windows: list[tuple[float, float]] = []
        partition = self.partition()
        windows.append(partition["window"])
        group = self.group(rate / 2)
        windows.append(group["window"])
        for stop in (chat_stop, self.folder / "stop-wide"):
            stop.touch()
        for proc in self.loads:
            proc.wait(timeout=60)

        chat = _outcomes(chat_out)
        wide = _outcomes(self.folder / "wide.jsonl")
        everything = chat + wide
        # A request belongs to a scenario when it was in flight at some time during it.
        outside = [o for o in everything if not any(_during(o, w) for w in windows)]
        cut = partition["window"][0]
        in_partition = [o for o in chat if _during(o, partition["window"]) and o["error"]]
        in_group = [o for o in wide if _during(o, group["window"]) and o["error"]]
        failed_outside = [o for o in outside if o["error"]]
        for o in failed_outside[:5] + in_partition[:3] + in_group[:3]:
            print(f"  failed: {o}")
        crossed = [capture.stop() for capture in self.captures.values()]
        plain_requests = sum(c.count(b"POST /v1/") for c in crossed)
        prompt_seen = any(PROMPT in c for c in crossed)
        https = sorted(self.endpoints) and all(e.startswith("https://") for e in self.endpoints)
        print(f"engine hops: endpoints {sorted(self.endpoints)}; captured "
              f"{sum(map(len, crossed))} bytes on B and C, {plain_requests} request lines "
              f"in clear, prompt seen {prompt_seen}")  # fmt: skip
        return {
            "tls": tls,
            "join_s": round(join_s, 3),
            "requests": len(everything),
            "failed": len(failed_outside),
            "partition_replaced_s": partition["replaced_s"],
            "partition_failed": len(in_partition),
            "partition_failed_late": sum(1 for o in in_partition if o["start"] > cut),
            "heal_duplicates_left": partition["duplicates"],
            "group_restart_s": group["restart_s"],
            "group_failed": len(in_group),
            "impersonation_refused": refused,
            "engine_tls": bool(https) and plain_requests == 0,
            "plaintext_prompt_seen": prompt_seen,
        }

    def _has_node(self, node: str) -> bool:
        return any(n["name"] == node for n in self.admin("/v1/nodes")["nodes"])

    def check_tls(self) -> bool:
        """From host B: every listener refuses plain HTTP and answers TLS."""
        verify = client_context(self.ca.read_bytes())

        def probe(url: str) -> tuple[bool, bool]:
            try:
                httpx.get(url.replace("https://", "http://"), timeout=5)
                plain_refused = False
            except httpx.TransportError:
                plain_refused = True
            try:
                httpx.get(url, verify=verify, timeout=5)
                served = True
            except httpx.TransportError:
                served = False
            return plain_refused, served

        ok = True
        for name, url in LISTENERS.items():
            plain_refused, served = call_in(self.net.netns("b"), functools.partial(probe, url))
            print(f"tls: {name}: plain HTTP refused {plain_refused}, TLS served {served}")
            ok = ok and plain_refused and served
        return ok

    def impersonate(self) -> bool:
        """A report with gpu-1's credential naming gpu-2, from host B: refused?"""
        kept = json.loads((self.agent_dir("b", "gpu-1") / "credential.json").read_text())
        report = AgentReport(node="gpu-2", boot_id="forged", seq=1, address="10.10.0.2",
                             gpus=[], shards=[])  # fmt: skip

        def send() -> int:
            return httpx.post(
                "https://10.10.0.1:7070/v1/report",
                content=report.model_dump_json(),
                headers={"authorization": f"Bearer {kept['credential']}"},
                verify=client_context(self.ca.read_bytes()),
                timeout=10,
            ).status_code

        status = call_in(self.net.netns("b"), send)
        print(f"impersonation: a report of gpu-1's credential naming gpu-2 got {status}")
        return bool(status == 403)

    def partition(self) -> dict[str, Any]:
        """Cut C off; wait until its replica serves on B; bring it back; wait until C holds
        nothing and the table holds the catalog's count."""
        cut = time.time()
        self.net.link("c", up=False)
        print("partition: host C's link is down")

        def replaced() -> bool:
            ready = self.ready("chat")
            return len(ready) == 2 and all(r["shards"][0]["node"] == "gpu-1" for r in ready)

        wait("C's replica to serve on B", replaced, 180, 0.25)
        replaced_s = time.time() - cut
        print(f"partition: C's replica serves on B {replaced_s:.1f}s after the cut")
        self.net.link("c", up=True)
        back = time.time()

        def settled() -> bool:
            nodes = {n["name"]: n for n in self.admin("/v1/nodes")["nodes"]}
            return nodes["gpu-2"]["ready"] and not self._engines_on("c", "gpu-2")

        wait("C to report again and stop what it no longer holds", settled, 90, 0.25)
        healed = time.time()
        duplicates = max(0, len(self.replicas("chat")) - 2) + len(self._engines_on("c", "gpu-2"))
        print(f"partition: healed {healed - back:.1f}s after the link came back")
        return {
            "window": (cut, healed),
            "replaced_s": round(replaced_s, 2),
            "duplicates": duplicates,
        }

    def _engines_on(self, host: str, node: str) -> list[int]:
        return [p for p in recorded_engine_pids(self.agent_dir(host, node)) if running(p)]

    def group(self, rate: float) -> dict[str, Any]:
        """`wide` of two shards on B and C; kill its rank 1; wait until it serves again."""
        catalog = self.folder / "a" / "group.yaml"
        catalog.write_text(GROUP_CATALOG)
        self.shells["a"].run(f"modelfleet ctl catalog apply {catalog}")
        [before] = wait("wide to serve", lambda: self.ready("wide"), 90, 0.25)
        _, out = self.load("wide", rate, "wide")
        wait("wide's load to run", lambda: _count(out) >= 3 * rate, 60)
        pids = [s["pid"] for s in before["shards"]]
        killed = time.time()
        os.kill(pids[1], signal.SIGKILL)

        def again() -> bool:
            ready = self.ready("wide")
            return bool(ready) and all(s["pid"] not in pids for s in ready[0]["shards"])

        wait("wide to serve again", again, 60, 0.1)
        restart_s = time.time() - killed
        print(f"group: rank 1 killed; the replica serves again {restart_s:.2f}s later")
        return {"window": (killed, time.time()), "restart_s": round(restart_s, 2)}


def _during(outcome: dict[str, Any], window: tuple[float, float]) -> bool:
    return bool(outcome["start"] <= window[1] and outcome["end"] >= window[0])


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _outcomes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def main() -> int:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s to chat")
    args = parser.parse_args()
    why = netns_unavailable()
    if why is not None:
        print(f"cannot run: {why}")
        json_line({"skipped": why})
        return 2
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-multihost-"))
    try:
        with Hosts(ADDRESSES) as net:
            bench = Bench(net, folder)
            try:
                result = bench.run(args.rate)
            finally:
                bench.end()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    targets = {
        "failed": result["failed"] == 0,
        "partition_failed_late": result["partition_failed_late"] == 0,
        "heal_duplicates_left": result["heal_duplicates_left"] == 0,
        "group_restart_s": result["group_restart_s"] <= 15,
        "join_s": result["join_s"] <= 5,
        "impersonation_refused": result["impersonation_refused"],
        "tls": result["tls"],
        "engine_tls": result["engine_tls"],
        "plaintext_prompt_seen": not result["plaintext_prompt_seen"],
    }
    for name, met in targets.items():
        print(f"target {name}: {'met' if met else 'MISSED'} ({result[name]})")
    json_line(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
