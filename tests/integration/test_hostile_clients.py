"""A security review's findings, against real processes: a control plane checks the admin
and agent tokens before anything else and slows down a guesser per address (the dashboard's
sign-in counting a try as its head arrives); a catalog nested too deep, sent as a dry run or
read from a file, is refused naming the limit (it crashed or stalled the control plane); a
router answers deep JSON and wrong-typed content parts with a 400 it counts (both were 500s).

Each guesser speaks from an address of its own on the loopback network (127.0.0.x), so that
one control plane serves every test of the module."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from .conftest import Procs, wait_json
from .test_processes import KEY, PUSH_TOKEN, control_plane_run, router_metrics, start_router
from .test_router_data_path import counter

ADMIN_TOKEN = "admin-token-of-the-hostile-test"
AGENT_TOKEN = "agent-token-of-the-hostile-test"
DEEP = "models: " + "[" * 100_000 + "]" * 100_000  # 200 KB: a segfault in PyYAML's composer
WIDE = "models: " + "{a: " * 10_000 + "1" + "}" * 10_000  # 40 KB: 25 s in libyaml's scanner
REFUSED_INVALID = 'modelfleet_router_refusals_total{model="-",reason="invalid",status="400"}'


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Procs, dict[str, str]]]:
    """One control plane (its agent and admin URLs), with an empty catalog."""
    tmp = tmp_path_factory.mktemp("hostile")
    procs = Procs(tmp)
    (tmp / "catalog.yaml").write_text("models: []\n")
    config = {"catalog": str(tmp / "catalog.yaml"), "state_dir": str(tmp / "cp"),
              "admin_token": ADMIN_TOKEN, "agent_token": AGENT_TOKEN,
              "agent_port": 0, "admin_port": 0}  # fmt: skip
    (tmp / "cp.yaml").write_text(yaml.safe_dump(config))
    try:
        started = procs.start("control-plane", "--config", str(tmp / "cp.yaml"),
                              "--ready-file", str(tmp / "cp.json"), log="cp")  # fmt: skip
        yield procs, wait_json(tmp / "cp.json", started)["urls"]
    finally:
        procs.stop_all()


def client_from(source: str, token: str | None = None) -> httpx.Client:
    """A client whose requests come from the loopback address `source`."""
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(transport=transport, headers=headers, timeout=30)


def test_admin_token_guesses_wait_after_three_and_are_said_in_the_log_once_per_wait(
    cp: tuple[Procs, dict[str, str]],
) -> None:
    """200 wrong admin tokens were 200 x 401 and no log line."""
    procs, urls = cp
    with client_from("127.0.0.2", "a-wrong-token") as guesser:
        answers = [guesser.get(f"{urls['admin']}/v1/catalog") for _ in range(200)]
    assert [a.status_code for a in answers[:3]] == [401] * 3
    assert {a.status_code for a in answers[3:]} == {429}
    assert answers[3].headers["retry-after"] == "1"
    assert "too many wrong admin tokens from 127.0.0.2" in answers[3].json()["error"]
    said = [line for line in procs.log("cp").splitlines() if "from 127.0.0.2" in line]
    assert len(said) == 3, said  # the three tries heard; none of the 197 refused unheard
    with client_from("127.0.0.3", ADMIN_TOKEN) as operator:  # another address is not slowed
        assert operator.get(f"{urls['admin']}/v1/catalog").status_code == 200


def test_agent_token_guesses_wait_after_three(cp: tuple[Procs, dict[str, str]]) -> None:
    _, urls = cp
    with client_from("127.0.0.4", "a-wrong-token") as guesser:
        answers = [guesser.post(f"{urls['agent']}/v1/heartbeat", content=b"{}") for _ in range(20)]
    assert [a.status_code for a in answers] == [401] * 3 + [429] * 17
    assert answers[3].headers["retry-after"] == "1"


def test_sign_ins_whose_heads_come_first_are_counted_as_they_arrive(
    cp: tuple[Procs, dict[str, str]],
) -> None:
    """300 sign-in heads sent first and their bodies later were all heard: the throttle
    counted a failure only once a body had come. Counted as heads arrive, the fourth and
    later are refused at once, their bodies unread."""
    _, urls = cp
    where = urlsplit(urls["admin"])
    body = b"token=a-wrong-token"
    head = (
        "POST /ui/login HTTP/1.1\r\nhost: cp\r\ncontent-type: application/x-www-form-urlencoded\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(30):
        sock = socket.create_connection((where.hostname, where.port), 30, ("127.0.0.5", 0))
        sock.sendall(head)
        socks.append(sock)
    try:
        answered: dict[socket.socket, bytes] = {}
        deadline = 20.0
        while len(answered) < 27 and deadline > 0:  # the 27 past the free three, unheard
            readable, _, _ = select.select([s for s in socks if s not in answered], [], [], 1)
            deadline -= 1 if not readable else 0
            for s in readable:
                answered[s] = s.recv(200)
        assert len(answered) == 27, f"{len(answered)} answered before their bodies were sent"
        assert all(a.startswith(b"HTTP/1.1 429") for a in answered.values()), answered
        for s in socks:
            if s not in answered:
                s.sendall(body)
                assert s.recv(200).startswith(b"HTTP/1.1 401")
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("catalog", [DEEP, WIDE], ids=["200KB-of-[", "40KB-of-{a:"])
def test_a_catalog_nested_too_deep_is_refused_naming_the_limit_and_the_leader_goes_on(
    cp: tuple[Procs, dict[str, str]], catalog: str
) -> None:
    """The 200 KB one sent as a dry run killed the control plane with a segfault; the 40 KB
    one held it about 25 s, and the leader stopped acting."""
    _, urls = cp
    with client_from("127.0.0.1", ADMIN_TOKEN) as operator:
        url = f"{urls['admin']}/v1/catalog"
        refused = operator.put(url, params={"dry_run": "true"}, content=catalog.encode())
        assert refused.status_code == 422, refused.text[:500]
        problem = refused.json()["problems"][0]["message"]
        assert "nested more than 64 levels deep" in problem and "the limit is 64" in problem
        assert operator.get(f"{urls['admin']}/v1/status").status_code == 200


def test_a_catalog_file_nested_too_deep_stops_the_control_plane_naming_the_limit(
    tmp_path: Path,
) -> None:
    (tmp_path / "catalog.yaml").write_text(DEEP)
    config = {"catalog": "catalog.yaml", "admin_token": ADMIN_TOKEN, "agent_token": AGENT_TOKEN}
    (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
    done = control_plane_run(tmp_path / "cp.yaml")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "nested more than 64 levels deep" in done.stderr and "the limit is 64" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_router_config_nested_too_deep_stops_the_router_naming_the_limit(
    tmp_path: Path,
) -> None:
    """The router's own catalog (its config's `models`) is YAML read by the same check."""
    (tmp_path / "router.yaml").write_text(f"port: 0\n{DEEP}\n")
    done = subprocess.run(
        [sys.executable, "-m", "modelfleet", "router", "--config", str(tmp_path / "router.yaml")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "nested more than 64 levels deep" in done.stderr and "the limit is 64" in done.stderr


def test_a_router_answers_deep_json_and_wrong_typed_content_parts_with_a_400_it_counts(
    procs: Procs, tmp_path: Path
) -> None:
    """Both were a 500 with a traceback, not counted in the router's metrics. (The content
    parts' text is read for a key with limits, to estimate its tokens.)"""
    router = start_router(
        procs, tmp_path, [{"name": "m", "endpoints": []}],
        api_keys=[{"name": "t", "key": KEY, "rpm": 1000}], push_token=PUSH_TOKEN,
    )  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": 5}]
    chat: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    with httpx.Client(base_url=router, headers=headers, timeout=30) as c:
        answers = [
            c.post("/v1/chat/completions", content=deep),
            c.post("/v1/chat/completions", json=chat),
        ]
    page = router_metrics(tmp_path)
    for answer in answers:
        assert answer.status_code == 400, answer.text[:500]
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "nested more than 64 levels deep" in answers[0].json()["error"]["message"]
    assert answers[1].json()["error"]["param"] == "messages[0].content[1].text"
    assert counter(page, REFUSED_INVALID) == 2, page
    assert "Traceback" not in procs.log("router")
