"""Requests held for a model that follows its load while it has no replica serving them.

A model with `autoscale` stays in the routing table at zero replicas (*cold*). A request for
it is held here instead of refused, in arrival order, up to the model's `cold_queue`
requests and for up to its `cold_timeout` seconds; the control plane learns of them through
the router's load (`GET /v1/load` answers at once when a cold model gets its first held
request) and starts a replica. When replicas serve, held requests are released at once, in
arrival order, each to the replica with the fewest requests of this router's in flight; the
engine takes what it can, as it takes any request (`target_in_flight` is the autoscaler's
target, not a cap: as a cap it throttled a cold model under load for as long as the load
lasted). Only while fewer replicas serve than the control plane is starting
(`replicas_wanted`) does one get no more than its share of the requests held since the model
had none: a hundred held requests do not all go to the first replica that comes up, and the
others, about to come, get theirs (for up to `SPREAD_WAIT_S` after the first came, so that a
replica that cannot start holds nothing up for long). Over the bound or past the timeout a
request gets 503 with `Retry-After` and `x-modelfleet-reason: cold-start`.

The hold then steps aside: a request that comes once the model has a replica serving goes
straight to the balancer, as for any model, even while held ones wait for their share of
replicas still to come.

A LoRA adapter loaded on no replica is held the same way (it is a model of the router's table,
`table.adapter_route`): the control plane learns of it from the load, has it loaded, and the
new table releases its requests to where it is; they are refused as `adapter-loading`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from modelfleet.router.refusal import Refusal, cannot_serve

if TYPE_CHECKING:
    from modelfleet.messages.wire import RoutedModel
    from modelfleet.router.balancer import Balancer
    from modelfleet.router.table import RoutingTable

COLD_RETRY_AFTER_S = 5  # what a refused held request is told to wait before it tries again
SPREAD_WAIT_S = 10.0  # how long held requests wait for their share to go to replicas to come


class Holdable(Protocol):
    """A request that can be held: a `Flight`."""

    def released(self, table: RoutingTable, endpoint: str | None) -> None:
        """Send it on to `endpoint`, a replica of its model in `table` (None: to the one
        the balancer picks)."""
        ...

    def refuse(self, refusal: Refusal) -> None:
        """Answer it with the router's own error, and end it."""
        ...


@dataclass
class _Held:
    request: Holdable
    since: float  # the event loop's time when it was held
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Episode:
    """A model's requests held since its queue was last empty: how many, and where those
    released went."""

    held: int = 0
    sent: Counter[str] = field(default_factory=Counter)
    spread_until: float | None = None  # set at the first release: the share's deadline
    timer: asyncio.TimerHandle | None = None


class ColdHold:
    """The held requests of every model, in arrival order per model."""

    def __init__(self, balancer: Balancer, table: Callable[[], RoutingTable]) -> None:
        self.balancer = balancer
        self.table = table  # the router's current table
        self.queues: dict[str, deque[_Held]] = {}
        self.held: dict[Holdable, tuple[str, _Held]] = {}
        self.episodes: dict[str, _Episode] = {}
        self.held_total: Counter[str] = Counter()  # requests held since the start, by model
        # Set when a model with no replica gets its first held request (and by the router's
        # `watch_load`): the load's long poll answers at once, so that the control plane
        # starts a replica without waiting.
        self.news = asyncio.Event()

    @property
    def waiting(self) -> int:
        """Requests held now, over all models."""
        return len(self.held)

    def counts(self) -> dict[str, int]:
        """Requests held now, by model."""
        return {model: len(queue) for model, queue in self.queues.items() if queue}

    def waited(self) -> dict[str, float]:
        """Seconds the oldest request held now has waited, by model."""
        now = asyncio.get_running_loop().time()
        return {model: now - queue[0].since for model, queue in self.queues.items() if queue}

    def take(self, request: Holdable, route: RoutedModel, endpoints: tuple[str, ...]) -> bool:
        """Hold `request` for `route`'s model when that model follows its load and has no
        endpoint; refuse it when the queue is full. False: it is not held, and goes on as
        usual."""
        model = route.name
        queue = self.queues.get(model)
        if route.target_in_flight is None or endpoints:
            return False
        if queue is None:
            queue = self.queues[model] = deque()
        if len(queue) >= route.cold_queue:
            if model in self.table().parents:
                why = f"adapter `{model}` is loaded on no replica yet"
            else:
                why = f"`{model}` has no replica serving yet"
            request.refuse(
                self._refusal(
                    model,
                    f"{why} and this router already holds {len(queue)} requests for it (its "
                    "cold_queue); try again shortly.",
                )
            )
            return True
        loop = asyncio.get_running_loop()
        entry = _Held(request, since=loop.time())
        entry.timer = loop.call_later(
            route.cold_timeout, self._expire, request, model, route.cold_timeout
        )
        if not queue:
            self.news.set()
        self.episodes.setdefault(model, _Episode()).held += 1
        self.held_total[model] += 1
        queue.append(entry)
        self.held[request] = (model, entry)
        return True

    def discard(self, request: Holdable) -> None:
        """`request` ended while held (its client went away): it is held no more."""
        found = self.held.pop(request, None)
        if found is None:
            return
        model, entry = found
        if entry.timer is not None:
            entry.timer.cancel()
        queue = self.queues[model]
        queue.remove(entry)
        if not queue:
            self._over(model)

    def _expire(self, request: Holdable, model: str, timeout: float) -> None:
        if request not in self.held:
            return
        self.discard(request)
        if model in self.table().parents:
            why = f"Adapter `{model}` was loaded on no replica"
        else:
            why = f"No replica of `{model}` came up"
        request.refuse(
            self._refusal(
                model,
                f"{why} within {timeout:g} s (its cold_timeout) while this request was held; "
                "try again shortly.",
            )
        )

    def release_all(self) -> None:
        """Release what each model's replicas can take now (a new table came)."""
        for model in list(self.queues):
            self.release(model)

    def _over(self, model: str) -> None:
        """`model` holds nothing any more: its episode ends."""
        self.queues.pop(model, None)
        episode = self.episodes.pop(model, None)
        if episode is not None and episode.timer is not None:
            episode.timer.cancel()

    def release(self, model: str) -> None:
        """Release `model`'s held requests in arrival order, each to the usable endpoint with
        the fewest of this router's requests in flight (while replicas are still to come, one
        that has had less than its share). A model gone from the table, or no longer
        following its load, lets them all go (as the same request sent now would)."""
        queue = self.queues.get(model)
        if not queue:
            return
        table = self.table()
        route = table.routes.get(model)
        endpoints = table.models.get(model, ())
        if route is None or route.target_in_flight is None:
            self._let_go(model, table, route)
            return
        if not endpoints and (failed := adapter_failed(table, model) or cannot_serve(route)):
            # The adapter failed to load wherever it was tried, or no replica is on its way.
            self._over(model)
            for entry in queue:
                del self.held[entry.request]
                if entry.timer is not None:
                    entry.timer.cancel()
                entry.request.refuse(failed)
            return
        usable = [e for e in endpoints if self.balancer.usable(e)]
        state = self.balancer.state
        episode = self.episodes.setdefault(model, _Episode(held=len(queue)))
        share = self._share(model, episode, route, len(usable))
        while queue and usable:
            loads = {
                e: state[e].in_flight if e in state else 0
                for e in usable
                if share is None or episode.sent[e] < share
            }
            endpoint = min(loads, key=loads.__getitem__, default=None)
            if endpoint is None:
                break  # each serving one has had its share: the rest wait for those to come
            episode.sent[endpoint] += 1
            entry = queue.popleft()
            del self.held[entry.request]
            if entry.timer is not None:
                entry.timer.cancel()
            # Sends it at once (its attempt counts in the endpoint's in-flight before this
            # returns), or answers it: either way the next turn sees the new counts.
            entry.request.released(table, endpoint)
        if not queue:
            self._over(model)

    def _share(self, model: str, episode: _Episode, route: RoutedModel, serving: int) -> int | None:
        """The most held requests one endpoint gets while fewer serve than are wanted, until
        the episode's spread deadline; None: no share applies."""
        wanted = route.replicas_wanted or 0
        if not serving or serving >= wanted:
            return None
        loop = asyncio.get_running_loop()
        if episode.spread_until is None:
            episode.spread_until = loop.time() + SPREAD_WAIT_S
            episode.timer = loop.call_at(episode.spread_until, self.release, model)
        if loop.time() >= episode.spread_until:
            return None
        return math.ceil(episode.held / wanted)

    def _refusal(self, model: str, message: str) -> Refusal:
        """A held request's 503: `cold-start`, or `adapter-loading` for an adapter's."""
        reason = "adapter-loading" if model in self.table().parents else "cold-start"
        return Refusal(503, message, "server_error", reason, retry_after=COLD_RETRY_AFTER_S)

    def _let_go(self, model: str, table: RoutingTable, route: RoutedModel | None) -> None:
        queue = self.queues[model]
        self._over(model)
        for entry in queue:
            del self.held[entry.request]
            if entry.timer is not None:
                entry.timer.cancel()
        endpoints = table.models.get(model, ())
        for entry in queue:
            if route is not None and endpoints:
                entry.request.released(table, None)
                continue
            entry.request.refuse(
                Refusal(404, f"The model `{model}` does not exist.", "invalid_request_error",
                        "unknown-model", code="model_not_found", param="model")
                if route is None
                else Refusal(503, f"No replica of `{model}` is ready now; try again shortly.",
                             "server_error", "no-ready-replica", retry_after=1)
            )  # fmt: skip


def adapter_failed(table: RoutingTable, model: str) -> Refusal | None:
    """The 503 for a LoRA adapter that no replica holds and whose load failed, with the
    engine's words; None for anything else."""
    base = table.parents.get(model)
    error = table.routes[base].adapter_errors.get(model) if base is not None else None
    if error is None:
        return None
    return Refusal(
        503,
        f"The adapter `{model}` could not be loaded on any replica: {error}",
        "server_error",
        "adapter-failed",
    )
