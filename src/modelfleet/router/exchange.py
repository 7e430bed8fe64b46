"""What a request carries on its way through the router, shared by every stage of its
`Flight` (`flight.py`): the router's parts it uses, what is measured of it, its plan, and the
client's side."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from modelfleet.router.rates import Rates

if TYPE_CHECKING:
    from modelfleet.http.tracing import SpanSink
    from modelfleet.messages.wire import RoutedModel
    from modelfleet.router.balancer import Balancer
    from modelfleet.router.cold import ColdHold
    from modelfleet.router.limits import Limits
    from modelfleet.router.metrics import RouterMetrics
    from modelfleet.router.table import ApiKey, RoutingTable
    from modelfleet.router.upstream import Upstreams
    from modelfleet.router.usage import UsageLedger, UsageScanner


@dataclass(frozen=True)
class Settings:
    """The router's settings that the data path reads (`RouterConfig` names each)."""

    max_body_bytes: int
    first_byte_timeout: float
    chunk_timeout: float
    retries: int
    prefix_chars: int
    default_max_tokens: int


@dataclass(frozen=True)
class Parts:
    """What a request uses of its router, and nothing more: the replicas' balance and
    connections, the keys' limits, what is counted, and the clocks."""

    settings: Settings
    balancer: Balancer
    cold: ColdHold  # requests held for models with no replica serving
    upstreams: Upstreams
    limits: Limits
    metrics: RouterMetrics
    ledger: UsageLedger
    clock: Callable[[], float]  # a request's own timings
    now: Callable[[], float]  # ejections
    wall: Callable[[], float]  # keys' expiry and limits
    background: set[asyncio.Future[None]]  # settlements under way, awaited at close
    waiting: Waiting = field(default_factory=lambda: Waiting())  # for their first byte
    asked: Rates = field(default_factory=lambda: Rates())  # how often each adapter is asked
    # Where the spans of sampled requests go (`otlp_endpoint`); None: none are built.
    spans: SpanSink | None = None
    # Seconds from `clock`'s reading to the epoch, for spans' times.
    clock_to_epoch: float = 0.0

    def epoch_ns(self, reading: float) -> int:
        """A reading of `clock` as nanoseconds since the epoch, as spans carry times."""
        return int((reading + self.clock_to_epoch) * 1e9)


@dataclass
class Exchange:
    """What is measured of one request on its way."""

    request_id: str
    started: float
    trace_id: str  # the request's trace, taken from its `traceparent` or new
    span_id: str  # the router's span of the request, the parent of each attempt's
    caller_span: str | None = None  # the span of the `traceparent` it came with
    sampled: bool = True  # the caller's say, from its `traceparent`; ours when it made none
    path: str = ""
    model: str = "-"
    upstream_wait: float = 0.0  # seconds spent waiting for engines
    client_gone: bool = False
    status: int = 0
    first_byte_at: float | None = None
    failures: list[str] = field(default_factory=list)
    timeouts: int = 0  # attempts that got no first byte in time
    scanner: UsageScanner | None = None  # finds the tokens the answer used
    key: str | None = None  # the name of the client's key, once it is known
    # Attempts written to an engine that it did not refuse (an error status): for these an
    # engine may have generated tokens, reported or not.
    maybe_used: int = 0
    # Why the router answered it itself, sending it to no engine (`Refusal.reason`); None
    # once an engine was tried. Refused requests are kept out of the latency histograms.
    refusal: str | None = None


@dataclass
class Plan:
    """What a request asks for, read once from its body, and where it may go."""

    key: ApiKey
    path: str
    raw: bytes  # the body as the engine gets it
    table: RoutingTable  # taken once: a swap during the request is invisible to it
    endpoints: tuple[str, ...]
    route: RoutedModel
    stream: bool
    limited: bool  # the key has limits: the request is admitted before it is sent
    cost: int  # tokens reserved for the key's token limit
    prefix: bytes | None  # for prefix routing
    first: str | None = None  # the endpoint to try first: the one a held request went to


class Client(Protocol):
    """The client's side of a flight: where its answer goes, and how it says it has gone."""

    @property
    def send(self) -> Callable[[Any], Awaitable[None]]:
        """ASGI's `send`, for an answer relayed as it arrives."""
        ...

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, more: bool
    ) -> bool:
        """Send an answer's head and `body` now: the whole answer, or (`more`) its first
        bytes, the rest to follow by `send`. False when only `send` can, in a task."""
        ...

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once the client goes away (at once if it has); None: no more."""
        ...

    def host(self, run: Coroutine[Any, Any, None]) -> None:
        """Run `run` in a task of the request's own: the flight has to wait."""
        ...


class ClientGone(Exception):
    """The client went away; what was in flight for it is dropped."""


class Broken(Exception):
    """An engine's whole answer broke off after its first byte: the client's connection is
    closed short of the length it was promised."""


class Waiter(Protocol):
    """An attempt waiting for its engine's first byte, as `Waiting` holds it."""

    @property
    def endpoint(self) -> str: ...

    def give_up(self, why: str) -> None: ...


class Waiting:
    """The attempts waiting for their engine's first byte, by endpoint. When the router finds
    an engine unreachable (its load cannot be read: `EngineWatch.watch_once`), those are given up
    at once and go to other replicas, instead of each waiting out its first-byte timeout
    (minutes for a long completion): a host cut off takes no request with it but those
    already answering."""

    def __init__(self) -> None:
        self._of: dict[str, set[Waiter]] = {}

    def add(self, attempt: Waiter) -> None:
        self._of.setdefault(attempt.endpoint, set()).add(attempt)

    def discard(self, attempt: Waiter) -> None:
        attempts = self._of.get(attempt.endpoint)
        if attempts is not None:
            attempts.discard(attempt)
            if not attempts:
                del self._of[attempt.endpoint]

    def give_up(self, endpoint: str, why: str) -> int:
        """Give up every attempt waiting on `endpoint`; returns how many."""
        attempts = list(self._of.pop(endpoint, ()))
        for attempt in attempts:
            attempt.give_up(why)
        return len(attempts)
