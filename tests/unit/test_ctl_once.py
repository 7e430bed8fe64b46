"""Issue 57: ctl sends a change with a request id (`Idempotency-Key`), sends it again with
the same id while its answer is "may have been made", a bounded time, and says which
happened: made by the earlier attempt, made by this one, not made, or still not known."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modelfleet.ctl.client import AdminClient, AdminTarget, CtlError, MayHaveBeenMade
from modelfleet.messages import admin

CHANGED = {"dry_run": False, "changed": True, "version": 3, "steps": [], "pending": []}
UNKNOWN = {
    "error": "the store: no answer within 0.9s; the change may have been made",
    "may_have_been_made": True,
    "request_id": "x",
}
Answer = tuple[int, dict[str, object], dict[str, str]]


@contextmanager
def plane(answers: list[Answer]) -> Iterator[tuple[str, list[str | None]]]:
    """An admin API giving `answers` in turn (the last one again and again); yields its URL
    and the request id of each change it was sent."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(self.headers.get(admin.IDEMPOTENCY_KEY))
            status, body, headers = answers[min(len(seen), len(answers)) - 1]
            raw = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {"content-type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_POST = do_PUT

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def ctl(url: str, said: list[str], retry_for: float = 5.0) -> AdminClient:
    return AdminClient(AdminTarget(url, "token"), retry_for=retry_for, say=said.append)


REPLAYED = {admin.REPLAYED: "true"}


def test_a_change_that_may_have_been_made_is_asked_again_and_found_made_by_the_first() -> None:
    said: list[str] = []
    with plane([(503, UNKNOWN, {}), (200, CHANGED, REPLAYED)]) as (url, seen):
        answer = ctl(url, said).apply_catalog(b"models: []\n", dry_run=False)
    assert answer.version == 3
    assert len(seen) == 2 and seen[0] is not None and seen[0] == seen[1]
    assert said == [
        f"made by the earlier attempt (request id {seen[0]}), whose answer said it may have been"
    ]


def test_one_made_by_the_second_attempt_says_the_first_was_not() -> None:
    said: list[str] = []
    with plane([(503, UNKNOWN, {}), (200, CHANGED, {})]) as (url, seen):
        ctl(url, said).apply_catalog(b"models: []\n", dry_run=False)
    assert said == [f"made by this attempt (request id {seen[0]}); the earlier one was not"]


def test_one_refused_on_a_later_attempt_is_not_made() -> None:
    refused = (404, {"error": "no node 'gpu-9' has reported"}, {})
    with (
        plane([(503, UNKNOWN, {}), refused]) as (url, _),
        pytest.raises(CtlError, match=r"^not made \(request id \w+\): .*404"),
    ):
        ctl(url, []).mark("gpu-9", admin.MarkRequest(mark="cordoned"))


def test_a_key_made_by_the_earlier_attempt_says_so_and_what_to_do() -> None:
    gone = {"error": "key 'k' was made by an earlier attempt of this request; revoke it"}
    with (
        plane([(503, UNKNOWN, {}), (409, gone, REPLAYED)]) as (url, _),
        pytest.raises(CtlError, match=r"^made by the earlier attempt .*revoke it"),
    ):
        ctl(url, []).create_key(admin.KeyCreate(name="k"))


def test_one_whose_outcome_stays_unknown_is_asked_again_a_bounded_time_and_says_how() -> None:
    with plane([(503, UNKNOWN, {})]) as (url, seen), pytest.raises(MayHaveBeenMade) as raised:
        ctl(url, [], retry_for=2.5).apply_catalog(b"models: []\n", dry_run=False)
    assert 2 <= len(seen) <= 4 and len(set(seen)) == 1
    said = str(raised.value)
    assert f"may have been made (request id {seen[0]}" in said
    assert f"MODELFLEET_REQUEST_ID={seen[0]}" in said


def test_a_request_id_given_is_the_one_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFLEET_REQUEST_ID", "asked-again-1")
    with plane([(200, CHANGED, REPLAYED)]) as (url, seen):
        ctl(url, []).apply_catalog(b"models: []\n", dry_run=False)
    assert seen == ["asked-again-1"]


def test_a_refusal_with_no_earlier_attempt_is_said_as_it_is() -> None:
    refused = (503, {"error": "the store is unreachable since 10:00:00; nothing was changed"}, {})
    with (
        plane([refused]) as (url, seen),
        pytest.raises(CtlError, match=r"^http.*answered 503: .*nothing was changed"),
    ):
        ctl(url, []).apply_catalog(b"models: []\n", dry_run=False)
    assert len(seen) == 1
