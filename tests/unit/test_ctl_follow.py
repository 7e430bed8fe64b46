"""ctl given several control planes (`--admin URL1,URL2,...`) finds the one that answers: a
dead one costs it a refused connection, a frozen one a bounded wait; a change goes straight to
the leader they name, never to one that does not answer, and is sent twice only when it surely
was not made."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modelfleet.ctl.client import AdminClient, AdminTarget, MayHaveBeenMade, Unreachable

KEYS = b'{"keys": []}'
CHANGED = b'{"dry_run": false, "changed": true, "version": 9, "steps": [], "pending": []}'


class Plane:
    """A control plane's admin API as ctl meets it: it leads (answers), follows (redirects
    changes to `leader`, or answers 503 when it knows no leader), or answers nothing to a
    change it took (`swallow`: frozen mid-request)."""

    def __init__(self) -> None:
        self.leader: str | None = None  # where a follower sends changes
        self.leads = True
        self.epoch = 1  # of the lease, as it says in its status
        self.swallow = False
        self.changes = 0  # changes taken while leading
        self.asked = 0  # requests but those for its status
        self.request_ids: list[str | None] = []  # each change's Idempotency-Key
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, body: bytes, location: str | None = None) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                if location:
                    self.send_header("location", location)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/status":
                    self.answer(200, plane.status())
                    return
                plane.asked += 1
                self.answer(200, KEYS)

            def do_PUT(self) -> None:
                plane.asked += 1
                plane.request_ids.append(self.headers.get("idempotency-key"))
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if not plane.leads and plane.leader:
                    self.answer(307, b"", plane.leader + self.path)
                elif not plane.leads:
                    self.answer(503, b'{"error": "this control plane follows; no leader"}')
                elif plane.swallow:
                    plane.changes += 1
                    time.sleep(8)  # frozen after taking it: ctl's read timeout ends the wait
                else:
                    plane.changes += 1
                    self.answer(200, CHANGED)

            do_DELETE = do_PUT

        return Handler

    def status(self) -> bytes:
        """Its status: whether it leads, and the leader it names."""
        planes = [{"name": "leader", "agent_url": "", "admin_url": self.leader, "seen_ago_s": 0,
                   "leads": True, "answering": False}] if self.leader else []  # fmt: skip
        return json.dumps(
            {"settling": False, "reconcile_passes": 0, "catalog_version": 1, "routing_epoch": 1,
             "routing_version": 1, "nodes": 0, "replicas": 0, "pending": 0,
             "leading": self.leads, "lease_epoch": self.epoch, "control_planes": planes}
        ).encode()  # fmt: skip

    def __enter__(self) -> Plane:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def frozen_listener() -> Iterator[str]:
    """A SIGSTOPped control plane: its kernel completes the connection, nothing answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there: a connection is refused at once
    return f"http://127.0.0.1:{port}"


CATALOG = b"models: []\n"


def client(*urls: str, follow_for: float = 10.0) -> AdminClient:
    return AdminClient(AdminTarget(",".join(urls), "token"), follow_for=follow_for)


def test_a_read_skips_dead_and_frozen_control_planes_and_remembers_the_one_that_answered() -> None:
    with Plane() as live, frozen_listener() as frozen:
        ctl = client(dead_url(), frozen, live.url)
        began = time.monotonic()
        assert ctl.keys().keys == []
        # A dead one costs nothing, a frozen one the read timeout (5 s), not 10 s each.
        assert time.monotonic() - began < 8
        began = time.monotonic()
        assert ctl.keys().keys == []
        assert time.monotonic() - began < 1  # the one that answered is asked first
        assert live.asked == 2


def test_a_change_goes_to_the_leader_past_a_follower_that_names_a_dead_one() -> None:
    with Plane() as follower, Plane() as leader:
        follower.leads, follower.leader, follower.epoch = False, dead_url(), 1
        leader.epoch = 2
        answer = client(follower.url, leader.url).apply_catalog(CATALOG, dry_run=False)
        assert answer.version == 9
        assert (follower.asked, leader.changes) == (0, 1)


def test_a_change_goes_to_the_leader_past_a_frozen_control_plane_listed_first() -> None:
    """Issue 57: with the first control plane of ctl's list frozen (SIGSTOP), every change
    failed with "may have been made" though a healthy leader existed: it took the change's
    connection and never answered. ctl asks every one who leads first, and sends the change
    to the leader only."""
    with frozen_listener() as frozen, Plane() as leader:
        answer = client(frozen, leader.url).apply_catalog(CATALOG, dry_run=False)
        assert answer.version == 9 and leader.changes == 1


def test_a_change_waits_for_a_leader_within_its_deadline() -> None:
    with Plane() as plane:
        plane.leads = False  # an election under way: "this control plane follows"

        def elected() -> None:
            while plane.asked < 2:
                time.sleep(0.01)
            plane.leads = True

        threading.Thread(target=elected, daemon=True).start()
        answer = client(plane.url, dead_url(), follow_for=10).apply_catalog(CATALOG, dry_run=False)
        assert answer.version == 9 and plane.changes == 1
        plane.leads = False
        began = time.monotonic()
        with pytest.raises(Unreachable, match="follows"):
            client(plane.url, dead_url(), follow_for=0.5).apply_catalog(CATALOG, dry_run=False)
        assert time.monotonic() - began < 3


def test_a_change_that_was_sent_and_not_answered_is_not_sent_again() -> None:
    """A change made without a request id (forgetting a node) may have been made by the
    control plane that took it and never answered: it is sent nowhere else."""
    with Plane() as frozen_leader, Plane() as other:
        frozen_leader.swallow = True  # it says it leads, takes the change and freezes
        other.leads, other.leader = False, frozen_leader.url
        with pytest.raises(MayHaveBeenMade, match="may have been made"):
            client(frozen_leader.url, other.url).delete_node("gpu-1", force=False)
        assert (frozen_leader.changes, other.asked) == (1, 0)


def test_a_change_made_once_by_its_request_id_is_sent_on_with_the_same_id() -> None:
    """Issue 57: a catalog applied goes with a request id, made at most once whoever takes
    it: the control plane that took it and never answered is not waited for, the change
    goes to the next with the same id."""
    with Plane() as frozen_leader, Plane() as other:
        frozen_leader.swallow = True
        answer = client(frozen_leader.url, other.url).apply_catalog(CATALOG, dry_run=False)
        assert answer.version == 9
        assert (frozen_leader.changes, other.changes) == (1, 1)
        [first], [second] = frozen_leader.request_ids, other.request_ids
        assert first is not None and first == second
