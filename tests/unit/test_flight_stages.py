"""Each stage of a request's flight driven alone, without a router, an engine or a client:
admission (`router/admit.py`), the pick and why none answered (`router/pick.py`), the
relay (`router/relay.py`) and the settlement (`router/settle.py`). `test_flight.py` drives
them together through a real router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from modelfleet.router.admit import admission
from modelfleet.router.balancer import Balancer
from modelfleet.router.exchange import Broken, ClientGone, Exchange, Plan
from modelfleet.router.limits import Ticket
from modelfleet.router.limits.window import Refusal as LimitRefusal
from modelfleet.router.pick import engine_headers, exhausted, pick
from modelfleet.router.refusal import Refusal
from modelfleet.router.relay import Relay, answer_head, scanned
from modelfleet.router.settle import tokens_used
from modelfleet.router.upstream import Answer
from modelfleet.router.usage import UsageScanner

USAGE = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}'


def exchange(**fields: Any) -> Exchange:
    defaults: dict[str, Any] = dict(request_id="r-1", started=0.0, trace_id="t", span_id="s")
    return Exchange(**(defaults | fields))


# -- admit -----------------------------------------------------------------------------------


def test_an_admitted_request_keeps_its_ticket() -> None:
    ticket = Ticket(key="k", entry="e", tokens=10, slice=0)
    assert admission(ticket, "k", 10) is ticket


def test_a_request_over_a_limit_is_refused_naming_the_limit_and_when_to_retry() -> None:
    got = admission(LimitRefusal("tpm", 100, 2.5), "team-a", 40)
    assert isinstance(got, Refusal)
    assert (got.status, got.type, got.reason, got.code) == (
        429, "tokens", "key-tpm", "rate_limit_exceeded",
    )  # fmt: skip
    assert got.retry_after == 3 and "team-a" in got.message and "100 tokens" in got.message
    requests = admission(LimitRefusal("rpm", 5, 1.0), "team-a", 1)
    assert isinstance(requests, Refusal) and requests.type == "requests"


def test_an_unreachable_limits_store_is_a_503_not_a_429() -> None:
    got = admission(LimitRefusal("store", 0, 1.0), "k", 1)
    assert isinstance(got, Refusal)
    assert (got.status, got.reason, got.retry_after) == (503, "limits-store-unreachable", 1)


# -- pick ------------------------------------------------------------------------------------


def plan(endpoints: tuple[str, ...], first: str | None = None) -> Plan:
    # pick reads only where the request may go: the rest of a plan is not its business.
    return cast(Plan, SimpleNamespace(endpoints=endpoints, first=first, prefix=None))


def test_a_released_request_goes_first_where_it_was_released_then_where_the_balancer_says() -> None:
    p = plan(("a", "b"), first="b")
    tried: list[str] = []
    assert pick(p, tried, Balancer()) == "b"
    assert p.first is None
    tried.append("b")
    assert pick(p, tried, Balancer()) == "a"
    tried.append("a")
    assert pick(p, tried, Balancer()) is None


def test_an_engine_is_asked_with_its_own_key_and_the_try_as_the_trace_parent() -> None:
    table = SimpleNamespace(keys={"https://a:1": "Bearer engine-a"})
    p = cast(Plan, SimpleNamespace(table=table))
    ex = exchange(trace_id="4bf92f3577b34da6a3ce929d0e0e4736", sampled=False)
    keyed = dict(engine_headers(p, ex, "https://a:1", "00f067aa0ba902b7"))
    assert keyed["authorization"] == "Bearer engine-a" and keyed["x-request-id"] == "r-1"
    assert keyed["traceparent"] == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    assert "authorization" not in dict(engine_headers(p, ex, "http://b:2", "00f067aa0ba902b7"))


def test_why_no_replica_answered() -> None:
    none = exhausted(exchange(model="m"), [], 30.0)
    assert (none.status, none.reason) == (503, "all-ejected")
    silent = exhausted(exchange(model="m", timeouts=2), ["a", "b"], 30.0)
    assert (silent.status, silent.reason) == (504, "first-byte-timeout")
    assert "within 30 s (2 tried)" in silent.message
    failing = exhausted(exchange(model="m", timeouts=1), ["a", "b"], 30.0)
    assert (failing.status, failing.reason) == (503, "upstream-failed")


# -- relay -----------------------------------------------------------------------------------


class FakeAnswer:
    """An engine's answer: `chunks` come one per read; None: the engine goes silent."""

    def __init__(self, chunks: list[bytes | None], status: int = 200, **headers: str) -> None:
        self.status = status
        self.headers = {k.replace("_", "-"): v for k, v in headers.items()}
        self._chunks: Iterator[bytes | None] = iter(chunks)
        self.at_eof = not chunks

    async def read(self) -> bytes:
        chunk = next(self._chunks, b"")
        if chunk is None:
            await asyncio.Event().wait()
        remaining = list(self._chunks)
        self._chunks = iter(remaining)
        self.at_eof = not remaining
        return chunk or b""


def relayed(answer: FakeAnswer, stream: bool, gap: float = 5.0) -> tuple[list[Any], Any]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    relay = Relay(send, lambda: 0.0, gap, None, stream, "m", "e:1")

    async def go() -> Any:
        try:
            return await relay.run(cast(Answer, answer), [(b"content-type", b"x")], b"first")
        except (Broken, ClientGone) as exc:
            return exc

    return sent, asyncio.run(go())


def test_the_relay_sends_the_head_the_first_bytes_and_each_chunk_and_ends_with_the_last() -> None:
    sent, whole = relayed(FakeAnswer([b"one", b"two"]), stream=True)
    assert whole is True
    assert [m.get("body") for m in sent] == [None, b"first", b"one", b"two"]
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]


def test_a_stream_that_stalls_ends_with_an_error_event_and_a_whole_answer_is_cut_short() -> None:
    sent, whole = relayed(FakeAnswer([b"one", None]), stream=True, gap=0.05)
    assert whole is False
    last = sent[-1]
    assert last["more_body"] is False and last["body"].endswith(b"data: [DONE]\n\n")
    event = json.loads(last["body"].split(b"\n\n")[0].removeprefix(b"data: "))
    assert event["error"]["code"] == "upstream_stalled"
    _, broken = relayed(FakeAnswer([b"one", None]), stream=False, gap=0.05)
    assert isinstance(broken, Broken)


def test_a_client_gone_mid_answer_is_told_apart() -> None:
    async def send(message: dict[str, Any]) -> None:
        raise ConnectionResetError

    relay = Relay(send, lambda: 0.0, 5.0, None, True, "m", "e:1")
    with pytest.raises(ClientGone):
        asyncio.run(relay.run(cast(Answer, FakeAnswer([b"x"])), [], b""))


def test_the_head_keeps_the_length_unless_the_body_is_changed_and_names_why_on_a_503() -> None:
    table = SimpleNamespace(replicas={"e:1": "m/0"})
    p = cast(Plan, SimpleNamespace(table=table, stream=False))
    answer = cast(Answer, FakeAnswer([], 503, content_length="12", retry_after="4"))
    head = dict(answer_head(answer, p, "e:1", "r-1", None))
    assert head[b"content-length"] == b"12" and head[b"x-modelfleet-replica"] == b"m/0"
    assert head[b"x-modelfleet-reason"] == b"engine" and head[b"retry-after"] == b"4"
    hiding = UsageScanner(stream=True, hide_usage_event=True)
    assert b"content-length" not in dict(answer_head(answer, p, "e:1", "r-1", hiding))


def test_scanned_reads_the_usage_on_the_way() -> None:
    scanner = UsageScanner(stream=False, hide_usage_event=False)
    assert scanned(scanner, USAGE, last=True) == USAGE
    assert scanner.usage is not None and scanner.usage.total == 5
    assert scanned(None, b"as is", last=False) == b"as is"


# -- settle ----------------------------------------------------------------------------------


def test_a_reservation_is_settled_to_what_was_used_or_kept_when_an_engine_may_have_worked() -> None:
    scanner = UsageScanner(stream=False, hide_usage_event=False)
    scanned(scanner, USAGE, last=True)
    assert tokens_used(exchange(scanner=scanner)) == 5
    assert tokens_used(exchange(maybe_used=1)) is None  # the reservation stands
    assert tokens_used(exchange(maybe_used=0)) == 0  # no engine took it
