"""What the router learns of its engines besides its own requests: each engine's queue depth
and KV cache in use, and its own histograms of time to first token and between tokens (for
the dashboard's plots), read from its metrics every `watch_interval` (how the balancer sees
load other routers send), an engine that stops answering those reads ejected (and the
requests waiting on it sent elsewhere at once), and each ejected engine probed back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from modelfleet.router.balancer import Balancer
from modelfleet.router.config import RouterConfig
from modelfleet.router.engine_load import read_engine_page
from modelfleet.router.exchange import Parts
from modelfleet.router.metrics import RouterMetrics
from modelfleet.router.table import RoutingTable

log = logging.getLogger("modelfleet.router")

UNREACHABLE_AFTER = 2  # reads of an engine's load in a row with no answer: it is ejected


class Watched(Protocol):
    """What the watch uses of its router (`Router`)."""

    config: RouterConfig
    table: RoutingTable
    balancer: Balancer
    engine_cache: dict[str, float]
    metrics: RouterMetrics
    parts: Parts
    now: Callable[[], float]

    @property
    def session(self) -> aiohttp.ClientSession: ...

    def engine_tls(self, endpoint: str) -> dict[str, Any]: ...


class EngineWatch:
    """The engines of one router's table, watched."""

    def __init__(self, router: Watched) -> None:
        self.router = router
        self._unanswered: dict[str, int] = {}  # endpoint -> reads of its load unanswered in a row

    async def run(self) -> None:
        """Every `watch_interval`, `watch_once`; runs until cancelled."""
        interval = self.router.config.watch_interval
        if interval <= 0:
            return
        while True:
            await self.watch_once()
            await asyncio.sleep(interval)

    async def watch_once(self) -> None:
        """Read each engine's queue depth, and probe the ejected engines whose time out is
        up."""
        timeout = aiohttp.ClientTimeout(total=max(self.router.config.watch_interval, 1.0))
        table = self.router.table
        for gone in self._unanswered.keys() - set(table.endpoints):
            del self._unanswered[gone]
        self.router.metrics.engine_times.keep_only(table.endpoints)
        # Each engine's model (an adapter's engines are its base model's).
        owners = {
            e: m for m, found in table.models.items() if m not in table.parents for e in found
        }
        probes = self.router.balancer.probe_due(self.router.now())
        await asyncio.gather(
            *(
                self._read_load(e, owners.get(e), timeout)
                for e in table.endpoints
                if e not in probes
            ),
            *(self._probe(e, timeout) for e in probes),
        )

    async def _read_load(
        self, endpoint: str, model: str | None, timeout: aiohttp.ClientTimeout
    ) -> None:
        try:
            async with self.router.session.get(
                endpoint + "/metrics", timeout=timeout, **self.router.engine_tls(endpoint)
            ) as answer:
                self._unanswered.pop(endpoint, None)
                if answer.status != 200:
                    return
                text = await answer.text()
        except (TimeoutError, aiohttp.ClientError):
            self._no_answer(endpoint)
            return
        read = read_engine_page(text)
        if read.load is not None:
            self.router.balancer.set_engine_load(endpoint, read.load)
        if read.cache is not None:
            self.router.engine_cache[endpoint] = read.cache
        self.router.metrics.engine_times.take(endpoint, model, read.times)

    def _no_answer(self, endpoint: str) -> None:
        """`endpoint` did not answer a read of its load. After UNREACHABLE_AFTER in a row (a
        host cut off, an engine hung), it is ejected, and the requests waiting for its first
        byte go to other replicas at once; a probe brings it back once it answers."""
        missed = self._unanswered.get(endpoint, 0) + 1
        self._unanswered[endpoint] = missed
        why = f"engine unreachable: {missed} reads of its load in a row got no answer"
        if missed < UNREACHABLE_AFTER or not self.router.balancer.eject(
            endpoint, self.router.now(), why
        ):
            return
        del self._unanswered[endpoint]
        self.router.metrics.ejections.labels(endpoint).inc()
        moved = self.router.parts.waiting.give_up(endpoint, why)
        log.warning("endpoint %s ejected: %s; %d waiting request(s) sent elsewhere", endpoint,
                    why, moved)  # fmt: skip

    async def _probe(self, endpoint: str, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.router.session.get(
                endpoint + "/health", timeout=timeout, **self.router.engine_tls(endpoint)
            ) as answer:
                healthy = answer.status == 200
        except (TimeoutError, aiohttp.ClientError):
            healthy = False
        self.router.balancer.probed(endpoint, healthy, self.router.now())
        if healthy:
            log.info("endpoint %s answered its probe; back in rotation", endpoint)
