"""Agents that join with a join token: real processes on 127.0.0.1 (with `tls: on`).

An agent pins the fleet's CA by the fingerprint its token carries, exchanges the token once
for a credential of its own node, keeps it (0600), and reports only as itself; a node revoked
by an operator is cut off at once and its replica is replaced on another node.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.agent.credential import CREDENTIAL_FILE
from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.network import address_beyond_loopback
from modelfleet.host.processes import stop_groups
from modelfleet.messages.wire import AgentReport, JoinAnswer, JoinRequest
from modelfleet.security.joining import JoinToken
from modelfleet.security.pki import client_context, node_host, request

from .conftest import Procs, wait_for, wait_json

ADMIN_TOKEN = "admin-token-of-the-test"
SHARED_TOKEN = "shared-agent-token-of-the-test"


class Fleet:
    """A control plane on TLS with no shared agent token, and what the test does to it."""

    def __init__(self, procs: Procs, folder: Path, host: str = "127.0.0.1") -> None:
        self.procs, self.folder = procs, folder
        (folder / "catalog.yaml").write_text(
            yaml.safe_dump({"models": [{"name": "m", "engine": "sim", "replicas": 1}]})
        )
        config = {
            "catalog": "catalog.yaml", "state_dir": "state", "admin_token": ADMIN_TOKEN,
            "tls": "on", "agent_port": 0, "admin_port": 0, "heartbeat_interval": 0.5,
            "settle_for": -1, "agent_token": SHARED_TOKEN, "host": host,
        }  # fmt: skip
        (folder / "cp.yaml").write_text(yaml.safe_dump(config))
        ready = folder / "cp.json"
        self.cp = procs.start(
            "control-plane", "--config", str(folder / "cp.yaml"), "--ready-file", str(ready),
            log="cp",
        )  # fmt: skip
        found = wait_json(ready, self.cp)
        self.agent_url, self.admin_url = found["urls"]["agent"], found["urls"]["admin"]
        self.ca_file = Path(found["ca_file"])
        self.fingerprint = found["ca_fingerprint"]
        self.ca = client_context(self.ca_file.read_bytes())

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
        return subprocess.run(
            [sys.executable, "-m", "modelfleet", "ctl", "--admin", self.admin_url, "--token",
             ADMIN_TOKEN, "--ca", str(self.ca_file), *args],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip

    def ctl_json(self, *args: str) -> Any:
        done = self.ctl("-o", "json", *args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def join_token(self, uses: int | None) -> str:
        """A new join token; `uses` None: as many as `ctl join-tokens create` gives."""
        told = [] if uses is None else ["--uses", str(uses)]
        done = self.ctl("join-tokens", "create", *told, "--ttl", "10m", "-q")
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def agent_args(self, node: str, token: str | None) -> list[str]:
        return [
            "agent", "--join", self.agent_url, "--node", node, "--simulate-gpus", "1x80GB",
            "--state-dir", str(self.folder / node), "--admin-port", "0",
            *(["--token", token] if token else []),
        ]  # fmt: skip

    def start_agent(self, node: str, token: str | None, run: str) -> dict[str, Any]:
        ready = self.folder / f"{run}.json"
        args = [*self.agent_args(node, token), "--ready-file", str(ready)]
        started = self.procs.start(*args, log=run)
        found = wait_json(ready, started)
        found["pid"] = started.pid
        return found

    def run_agent(self, node: str, token: str) -> subprocess.CompletedProcess[str]:
        """An agent run that is expected to exit (refused) before it reports."""
        return subprocess.run(
            [sys.executable, "-m", "modelfleet", *self.agent_args(node, token)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def join_raw(self, token: str, node: str, names: list[str]) -> tuple[httpx.Response, bytes]:
        """A join as an attacker holding `token` makes it: its own certificate request for
        `names`. The answer, and the private key of the request."""
        key, csr = request(names)
        answer = httpx.post(
            self.agent_url + "/v1/join",
            content=JoinRequest(node=node, csr=csr.decode()).model_dump_json(),
            headers={"authorization": f"Bearer {token}"},
            verify=self.ca,
            timeout=10,
        )
        return answer, key

    def refusals(self) -> int:
        """Reports and heartbeats the control plane refused for their credential (401)."""
        page = httpx.get(
            self.admin_url + "/metrics",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            verify=self.ca,
            timeout=10,
        ).text
        line = next(
            (x for x in page.splitlines() if x.startswith("modelfleet_controlplane_agent_"
             "requests_refused_total") and 'why="credential"' in x),
            "x 0",
        )  # fmt: skip
        return int(float(line.split()[-1]))

    def credential(self, node: str) -> str:
        kept = json.loads((self.folder / node / CREDENTIAL_FILE).read_text())
        return str(kept["credential"])

    def report(self, credential: str, node: str, address: str = "127.0.0.1") -> httpx.Response:
        body = AgentReport(node=node, boot_id="forged", seq=1, address=address, gpus=[],
                           shards=[])  # fmt: skip
        return httpx.post(
            self.agent_url + "/v1/report",
            content=body.model_dump_json(),
            headers={"authorization": f"Bearer {credential}"},
            verify=self.ca,
            timeout=10,
        )

    def replicas(self) -> list[dict[str, Any]]:
        return list(self.ctl_json("replicas")["replicas"])


@pytest.fixture
def fleet(procs: Procs, tmp_path: Path) -> Any:
    made = Fleet(procs, tmp_path)
    yield made
    # Engines outlive their agents by design: once the agents have stopped (and recorded
    # them), the engines they started are ended too, by their process groups.
    procs.stop_all()
    for node in ("b", "c", "node-2"):
        stop_groups(recorded_engine_pids(tmp_path / node), grace=10)


def test_an_agent_joins_with_a_token_and_then_speaks_only_as_its_own_node(fleet: Fleet) -> None:
    token = fleet.join_token(uses=1)
    parsed = JoinToken.parse(token)
    assert parsed.ca_fingerprint == fleet.fingerprint

    # A token that pins another CA is refused before its secret is sent anywhere.
    forged = str(JoinToken(parsed.id, parsed.secret, "sha256:" + "0" * 64))
    refused = fleet.run_agent("b", forged)
    assert refused.returncode == 2, refused.stderr
    assert f"fingerprint {fleet.fingerprint}, not the sha256:{'0' * 64}" in refused.stderr
    assert not (fleet.folder / "b" / CREDENTIAL_FILE).exists()

    b = fleet.start_agent("b", token, "agent-b")
    kept = fleet.folder / "b" / CREDENTIAL_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert parsed.secret not in kept.read_text()  # the token is used once, then never kept

    # The token allowed one join: a second machine is refused with the reason.
    used_up = fleet.run_agent("c", token)
    assert used_up.returncode == 2 and "used up" in used_up.stderr, used_up.stderr

    # The agent's admin API serves TLS with a certificate of the fleet's CA that names node b
    # (checked by that name), and takes the node's credential. It does not name 127.0.0.1:
    # the control plane is reached there, and a node's certificate must not pass for it.
    admin = b["urls"]["admin"]
    assert admin.startswith("https://127.0.0.1:")
    credential_b = fleet.credential("b")
    with httpx.Client(verify=fleet.ca, timeout=10) as client:
        gpus = client.get(
            admin + "/v1/gpus",
            headers={"authorization": f"Bearer {credential_b}"},
            extensions={"sni_hostname": node_host("b")},
        )
    assert gpus.status_code == 200 and len(gpus.json()["gpus"]) == 1
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(admin + "/v1/gpus", verify=fleet.ca, timeout=10)
    with pytest.raises(httpx.TransportError):
        httpx.get(admin.replace("https://", "http://") + "/v1/gpus", timeout=5)

    fleet.start_agent("c", fleet.join_token(uses=1), "agent-c")
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    assert set(nodes) == {"b", "c"}

    # b's credential may speak for b only: a report naming c is refused and logged.
    impersonation = fleet.report(credential_b, "c")
    assert impersonation.status_code == 403, impersonation.text
    assert "node b's: it may not speak for node c" in impersonation.json()["error"]
    wait_for(
        "the refusal in the control plane's log",
        lambda: "may not speak for node c" in fleet.procs.log("cp"),
    )

    # A restarted agent uses the credential it kept; it needs no token any more.
    stop_groups([b["pid"]], grace=20)
    fleet.start_agent("b", None, "agent-b-again")
    assert fleet.ctl_json("nodes")["nodes"][0]["name"] == "b"


def test_a_revoked_node_is_cut_off_at_once_and_its_replica_served_elsewhere(
    fleet: Fleet,
) -> None:
    token = fleet.join_token(uses=2)
    for node in ("b", "c"):
        fleet.start_agent(node, token, f"agent-{node}")

    def serving() -> list[dict[str, Any]]:
        return [r for r in fleet.replicas() if r["state"] == "ready"]

    [first] = wait_for("the replica of m to serve", serving, timeout=60)
    host = first["shards"][0]["node"]
    other = "c" if host == "b" else "b"

    revoked = fleet.ctl("nodes", "revoke", host)
    assert revoked.returncode == 0, revoked.stderr
    assert f"node {host} revoked" in revoked.stdout and first["id"] in revoked.stdout
    # Cut off at once: the credential it reports with is refused from now on.
    assert fleet.report(fleet.credential(host), host).status_code == 401
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    assert nodes[host]["mark"] == "revoked"

    def replaced() -> list[dict[str, Any]]:
        return [r for r in serving() if r["shards"][0]["node"] == other]

    wait_for(f"the replica of m to serve on {other}", replaced, timeout=60)
    uncordon = fleet.ctl("uncordon", host)
    assert uncordon.returncode == 1 and "joining anew" in uncordon.stderr
    told = fleet.ctl_json("events", "--for", f"node/{host}")["events"]
    assert [e["reason"] for e in told if e["reason"] in ("NodeJoined", "NodeRevoked")] == [
        "NodeJoined",
        "NodeRevoked",
    ]


def test_a_join_token_buys_no_certificate_ctl_or_an_agent_would_take_for_the_control_plane(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Issue 39: a join whose certificate request named the control plane's own address got a
    fleet-CA certificate for it, and ctl then sent the admin token to an impostor serving
    it. Now the certificate names the node, and not the address the control plane is
    reached by: an impostor serving it is refused by ctl before anything is sent."""
    import http.server
    import ssl
    import threading

    from cryptography import x509

    answer, key = fleet.join_raw(fleet.join_token(uses=1), "mallory", ["127.0.0.1"])
    assert answer.status_code == 200, answer.text
    joined = JoinAnswer.model_validate_json(answer.content)
    cert = x509.load_pem_x509_certificate(joined.cert.encode())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt.get_values_for_type(x509.IPAddress) == []
    assert alt.get_values_for_type(x509.DNSName) == [node_host("mallory")]

    (tmp_path / "mallory.crt").write_text(joined.cert)
    (tmp_path / "mallory.key").write_bytes(key)
    heard: list[str] = []

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            heard.append(self.headers.get("authorization", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "mallory.crt", tmp_path / "mallory.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
        done = subprocess.run(
            [sys.executable, "-m", "modelfleet", "ctl", "--admin", url, "--token", ADMIN_TOKEN,
             "--ca", str(fleet.ca_file), "status"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert done.returncode != 0 and "certificate" in done.stderr.lower(), done.stderr
        assert heard == []  # the admin token never reached it
    finally:
        server.shutdown()
        server.server_close()

    # A request for a host name (the control plane's, a wildcard) is refused outright.
    for name in ("localhost", "*.example"):
        refused, _ = fleet.join_raw(fleet.join_token(uses=1), "mallory-2", [name])
        assert refused.status_code == 400 and "never a host name" in refused.text, refused.text


def test_a_join_never_takes_the_name_of_a_node_that_reports_with_the_shared_token(
    fleet: Fleet,
) -> None:
    """Issue 39: a join under node-2, a node already reporting (with the fleet's shared
    agent token), got a credential, and the real agent was refused from then on. A name the
    fleet knows is refused (409); the node keeps reporting."""
    shared = fleet.procs.start(
        "agent", "--control-plane", fleet.agent_url, "--node", "node-2", "--simulate-gpus",
        "1x80GB", "--state-dir", str(fleet.folder / "node-2"), "--ca", str(fleet.ca_file),
        "--token", SHARED_TOKEN, "--ready-file", str(fleet.folder / "node-2.json"),
        log="agent-node-2",
    )  # fmt: skip
    wait_json(fleet.folder / "node-2.json", shared)
    answer, _ = fleet.join_raw(fleet.join_token(uses=1), "node-2", ["127.0.0.1"])
    assert answer.status_code == 409, answer.text
    assert "node node-2 is a node of the fleet already" in answer.json()["error"]
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    assert set(nodes) == {"node-2"} and nodes["node-2"]["ready"], nodes
    assert "refused" not in fleet.procs.log("agent-node-2")


def test_a_revoked_agent_says_so_once_and_joins_anew_when_given_a_new_token(
    fleet: Fleet,
) -> None:
    """Issue 39: a revoked agent logged a generic "wrong agent token" every 2 s and never said
    it was revoked; re-added with the README's steps (revoke, then the agent run with a new
    token) it kept its refused credential and ignored the token, forever. Now it says once
    that it was revoked, waits longer after each refusal, and joins anew with a token given."""
    b = fleet.start_agent("b", fleet.join_token(uses=1), "agent-b")
    revoked = fleet.ctl("nodes", "revoke", "b")
    assert revoked.returncode == 0, revoked.stderr

    wait_for("the revoked agent refused three times", lambda: fleet.refusals() >= 3, 60)
    said = fleet.procs.log("agent-b")
    assert said.count("node b was revoked") == 1, said[-2000:]
    assert "refuses this agent: node b was revoked" in said
    assert "wrong agent token" not in said

    stop_groups([b["pid"]], grace=20)
    again = fleet.start_agent("b", fleet.join_token(uses=1), "agent-b-again")
    assert "joined anew as node b with the join token given" in fleet.procs.log("agent-b-again")
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    assert nodes["b"]["mark"] == "none" and nodes["b"]["ready"], nodes
    assert again["node"] == "b"


def test_join_tokens_create_says_to_give_the_token_by_file_and_that_joins(fleet: Fleet) -> None:
    """`ctl join-tokens create` told operators to run `agent --join URL --token TOKEN`: the
    token on a command line, which any local user can read with `ps` (the README forbids it).
    It names --token-file now; followed to the letter, the agent joins. An agent given no
    token is told the same."""
    made = fleet.ctl("join-tokens", "create", "--uses", "1", "--ttl", "10m")
    assert made.returncode == 0, made.stderr
    said = " ".join(made.stdout.split())
    assert "--token-file FILE" in said and "chmod 600 FILE" in said
    assert "--token TOKEN" not in said
    [token] = [ln[len("token: ") :] for ln in made.stdout.splitlines() if ln.startswith("token: ")]

    without = fleet.run_agent("b", "")
    assert without.returncode != 0 and "--token-file FILE" in without.stderr, without.stderr

    file = fleet.folder / "join-token"
    file.write_text(token + "\n")
    file.chmod(0o600)
    ready = fleet.folder / "agent-b.json"
    args = [*fleet.agent_args("b", None), "--token-file", str(file), "--ready-file", str(ready)]
    wait_json(ready, fleet.procs.start(*args, log="agent-b"))
    assert (fleet.folder / "b" / CREDENTIAL_FILE).exists()
    assert [n["name"] for n in fleet.ctl_json("nodes")["nodes"]] == ["b"]


def test_a_revoked_and_deleted_node_stays_out_though_its_agent_holds_the_token_it_joined_with(
    fleet: Fleet,
) -> None:
    """Issue (members): after the README's revoke and delete, the agent joined again by itself
    within about 2 s with the join token it was started with (good for any number of joins),
    and came back ready. Now the agent has forgotten that token once joined, and no token
    made before the revoke joins the name again, whoever holds it."""
    token = fleet.join_token(uses=5)
    fleet.start_agent("b", token, "agent-b")
    revoked = fleet.ctl("nodes", "revoke", "b")
    assert revoked.returncode == 0, revoked.stderr
    deleted = fleet.ctl("nodes", "delete", "b", "--force")
    assert deleted.returncode == 0, deleted.stderr

    # The agent is refused twice: the first refusal is where it joined again before.
    def refused_twice_or_back() -> bool:
        return fleet.refusals() >= 2 or "joined anew" in fleet.procs.log("agent-b")

    wait_for("the agent of b refused twice (or joined again)", refused_twice_or_back, 60)
    said = fleet.procs.log("agent-b")
    assert "refuses this agent" in said and "joined anew" not in said, said[-2000:]
    assert "its join token is forgotten" in said
    assert fleet.ctl_json("nodes")["nodes"] == []
    assert fleet.ctl_json("credentials")["credentials"] == []

    # Whoever holds the token gets nowhere with that name; other names still join with it.
    answer, _ = fleet.join_raw(token, "b", ["127.0.0.1"])
    assert answer.status_code == 403, answer.text
    assert "node b was revoked or deleted after join token" in answer.json()["error"]
    assert fleet.join_raw(token, "c", ["127.0.0.1"])[0].status_code == 200
    # A token made after the revoke puts a machine back under the name.
    assert fleet.join_raw(fleet.join_token(uses=1), "b", ["127.0.0.1"])[0].status_code == 200


def test_an_agent_forgets_its_join_token_in_the_files_it_was_given_it_in(fleet: Fleet) -> None:
    """Issue (members): the join token stayed in the agent's token file and its unit's env
    file for good. Once joined, the agent rewrites both without it (the rest of the env file
    kept), and a restart runs on its credential."""
    token = fleet.join_token(uses=1)
    token_file, env_file = fleet.folder / "b.token", fleet.folder / "b.env"
    token_file.write_text(token + "\n")
    env_file.write_text(f'HF_HOME="/models"\nMODELFLEET_AGENT_TOKEN="{token}"\n')
    for made in (token_file, env_file):
        made.chmod(0o600)
    given = ["--token-file", str(token_file), "--env-file", str(env_file)]
    ready = fleet.folder / "b.json"
    started = fleet.procs.start(
        *fleet.agent_args("b", None), *given, "--ready-file", str(ready), log="agent-b"
    )
    wait_json(ready, started)
    assert token_file.read_text() == ""
    assert env_file.read_text() == 'HF_HOME="/models"\n'
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert token not in fleet.procs.log("agent-b")

    stop_groups([started.pid], grace=20)
    again = fleet.folder / "b-again.json"
    restarted = fleet.procs.start(
        *fleet.agent_args("b", None), *given, "--ready-file", str(again), log="agent-b-again"
    )
    wait_json(again, restarted)
    nodes = {n["name"]: n for n in fleet.ctl_json("nodes")["nodes"]}
    assert nodes["b"]["ready"], nodes


def test_a_join_token_joins_one_node_unless_told_more(fleet: Fleet) -> None:
    """Issue (members): a join token was good for any number of joins by default. Now for
    one (`--uses N` for more)."""
    token = fleet.join_token(uses=None)
    [listed] = fleet.ctl_json("join-tokens", "list")["tokens"]
    assert listed["uses_left"] == 1
    assert fleet.join_raw(token, "b", ["127.0.0.1"])[0].status_code == 200
    second, _ = fleet.join_raw(token, "c", ["127.0.0.1"])
    assert second.status_code == 401 and "used up" in second.json()["error"], second.text
    three = fleet.join_token(uses=3)
    assert [fleet.join_raw(three, n, ["127.0.0.1"])[0].status_code for n in "def"] == [200] * 3


def test_every_credential_given_is_listed_until_revoked_whether_its_node_reported_or_not(
    fleet: Fleet,
) -> None:
    """Issue (members): 16 credentials made with join tokens for nodes that never reported
    appeared nowhere in `ctl nodes`. `ctl credentials` lists every credential given, and
    whether its node reported; `ctl nodes revoke` takes one back."""
    token = fleet.join_token(uses=3)
    for node in ("ghost-1", "ghost-2"):
        assert fleet.join_raw(token, node, ["127.0.0.1"])[0].status_code == 200
    fleet.start_agent("b", token, "agent-b")
    listed = {c["node"]: c for c in fleet.ctl_json("credentials")["credentials"]}
    assert {n: c["reported"] for n, c in listed.items()} == {
        "b": True,
        "ghost-1": False,
        "ghost-2": False,
    }
    assert listed["ghost-1"]["addresses"] == ["127.0.0.1"]
    assert listed["ghost-1"]["token_id"] == JoinToken.parse(token).id
    table = fleet.ctl("credentials")
    assert table.returncode == 0 and "ghost-2" in table.stdout and "never" in table.stdout

    revoked = fleet.ctl("nodes", "revoke", "ghost-1")
    assert revoked.returncode == 0, revoked.stderr
    left = [c["node"] for c in fleet.ctl_json("credentials")["credentials"]]
    assert left == ["b", "ghost-2"]


def test_a_node_joined_over_loopback_advertises_no_other_address(fleet: Fleet) -> None:
    """Issue (members): the control plane took any address a node advertised, and routers
    sent prompts there. A node joined from 127.0.0.1 advertising another address is refused
    (403), naming both; the address it joined from is taken."""
    answer, _ = fleet.join_raw(fleet.join_token(uses=1), "b", ["127.0.0.1"])
    credential = JoinAnswer.model_validate_json(answer.content).credential
    elsewhere = fleet.report(credential, "b", "192.0.2.77")
    assert elsewhere.status_code == 403, elsewhere.text
    said = elsewhere.json()["error"]
    assert "node b advertises '192.0.2.77'" in said and "advertise only 127.0.0.1 " in said
    assert fleet.ctl_json("nodes")["nodes"] == []
    wait_for("the refusal in the log", lambda: "advertises '192.0.2.77'" in fleet.procs.log("cp"))
    assert fleet.report(credential, "b", "127.0.0.1").status_code == 200


def test_a_join_token_may_allow_a_node_another_address_but_never_loopback(fleet: Fleet) -> None:
    """The operator's part of the rule: `ctl join-tokens create --address A` lets a node
    joining with it advertise A (a machine behind NAT, one serving on another network); a
    token never allows loopback, which only a loopback join gets."""
    no = fleet.ctl("join-tokens", "create", "--address", "127.0.0.1")
    assert no.returncode == 1 and "'127.0.0.1' is no address a join token may allow" in no.stderr
    done = fleet.ctl("join-tokens", "create", "--address", "192.0.2.77", "-q")
    assert done.returncode == 0, done.stderr
    [listed] = fleet.ctl_json("join-tokens", "list")["tokens"]
    assert listed["addresses"] == ["192.0.2.77"]
    answer, _ = fleet.join_raw(done.stdout.strip(), "b", ["192.0.2.77"])
    assert answer.status_code == 200, answer.text
    credential = JoinAnswer.model_validate_json(answer.content).credential
    assert fleet.report(credential, "b", "192.0.2.77").status_code == 200
    refused = fleet.report(credential, "b", "192.0.2.78")
    assert refused.status_code == 403, refused.text
    [shown] = fleet.ctl_json("credentials")["credentials"]
    assert shown["addresses"] == ["127.0.0.1", "192.0.2.77"] and shown["reported"]


def test_a_node_that_joined_from_another_host_may_not_advertise_loopback(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue (members): a node that joined from another host and advertised 127.0.0.1 was
    given a replica, and the router sent clients' prompts and the engine key in plain HTTP to
    a listener on its own loopback. Now loopback is taken only from a loopback join. The join
    comes here from this machine's address beyond loopback (the control plane listens there),
    as one from another host would."""
    address = address_beyond_loopback()
    if address is None:
        pytest.skip("this machine has no address beyond loopback to join from")
    fleet = Fleet(procs, tmp_path, host=address)
    assert fleet.agent_url.startswith(f"https://{address}:")
    answer, _ = fleet.join_raw(fleet.join_token(uses=1), "b", [address])
    assert answer.status_code == 200, answer.text
    credential = JoinAnswer.model_validate_json(answer.content).credential
    for loopback in ("127.0.0.1", "::1", "localhost"):
        refused = fleet.report(credential, "b", loopback)
        assert refused.status_code == 403, refused.text
        assert f"advertise only {address} " in refused.json()["error"]
    assert fleet.ctl_json("nodes")["nodes"] == []
    assert fleet.report(credential, "b", address).status_code == 200
    [node] = fleet.ctl_json("nodes")["nodes"]
    assert node["name"] == "b" and node["address"] == address
