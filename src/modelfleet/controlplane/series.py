"""The routers' numbers over the last hour, per model: what the dashboard plots.

Every `interval` the control plane reads each router's metrics (through its push API, which
answers the sum over the router's workers), sums them over the routers, and keeps per model
one point per interval: requests, server errors and refusals per second, and the mean time
to first byte and mean request time of the requests engines answered in that interval. An
error is a request sent to an engine that got a 5xx; a refusal, one the router answered
itself (no key, a key over its limit, no replica ready...): two lines, so that 31 % refused
no longer shows as no errors, nor refusals as the engines' failures. A router that
restarted (its counters went down) counts from zero again; one that does not answer is left
out of that point. Memory: one hour of points per model, whatever the traffic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.controlplane.config import RouterTarget

log = logging.getLogger("modelfleet.controlplane")

KEEP_S = 3600.0


@dataclass(frozen=True)
class Point:
    """One interval's numbers of one model, summed over the routers."""

    at: float  # wall-clock time at its end
    requests_per_s: float
    errors_per_s: float  # requests sent to an engine, answered with a 5xx status
    refusals_per_s: float  # requests the router answered itself
    first_byte_s: float | None  # mean over the interval's requests; None: no request
    request_s: float | None


@dataclass
class Totals:
    """A router's counters of one model, as read."""

    requests: float = 0.0
    errors: float = 0.0
    refusals: float = 0.0
    first_byte_sum: float = 0.0
    first_byte_count: float = 0.0
    request_sum: float = 0.0
    request_count: float = 0.0

    def minus(self, earlier: Totals) -> Totals:
        """What was counted since `earlier`; all of it when a counter went down (a restart)."""
        pairs = [(getattr(self, f), getattr(earlier, f)) for f in _FIELDS]
        if any(now < then for now, then in pairs):
            return self
        return Totals(*(now - then for now, then in pairs))

    def plus(self, other: Totals) -> Totals:
        return Totals(*(getattr(self, f) + getattr(other, f) for f in _FIELDS))


_FIELDS = (
    "requests",
    "errors",
    "refusals",
    "first_byte_sum",
    "first_byte_count",
    "request_sum",
    "request_count",
)


def read_totals(text: str) -> dict[str, Totals]:
    """A router's metrics page, as counters per model."""
    out: dict[str, Totals] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            t = out.setdefault(model, Totals())
            name = sample.name
            if name == "modelfleet_router_requests_total":
                t.requests += sample.value
                if sample.labels.get("status", "").startswith("5"):
                    t.errors += sample.value
            elif name == "modelfleet_router_refusals_total":
                t.refusals += sample.value
                if sample.labels.get("status", "").startswith("5"):
                    t.errors -= sample.value  # the router's own 503, not an engine's
            elif name == "modelfleet_router_first_byte_seconds_sum":
                t.first_byte_sum = sample.value
            elif name == "modelfleet_router_first_byte_seconds_count":
                t.first_byte_count = sample.value
            elif name == "modelfleet_router_request_seconds_sum":
                t.request_sum = sample.value
            elif name == "modelfleet_router_request_seconds_count":
                t.request_count = sample.value
    return out


@dataclass
class Series:
    """The points of every model, an hour of them each."""

    interval: float
    points: dict[str, deque[Point]] = field(default_factory=dict)

    def add(self, at: float, seconds: float, counted: dict[str, Totals]) -> None:
        keep = max(2, int(KEEP_S / self.interval))
        for model, t in counted.items():
            self.points.setdefault(model, deque(maxlen=keep)).append(
                Point(
                    at=at,
                    requests_per_s=t.requests / seconds,
                    errors_per_s=t.errors / seconds,
                    refusals_per_s=t.refusals / seconds,
                    first_byte_s=t.first_byte_sum / t.first_byte_count
                    if t.first_byte_count
                    else None,
                    request_s=t.request_sum / t.request_count if t.request_count else None,
                )
            )

    def of(self, model: str) -> list[Point]:
        return list(self.points.get(model, ()))


class RouterSeries:
    """Reads the routers' metrics every `interval` into a `Series`."""

    def __init__(
        self,
        routers: Sequence[RouterTarget],
        http: httpx.AsyncClient,
        interval: float,
        wall: Callable[[], float],
    ) -> None:
        self.routers = list(routers)
        self.http = http
        self.wall = wall
        self.series = Series(interval)
        self._last: dict[str, dict[str, Totals]] = {}  # router url -> model -> as last read
        self._last_at: float | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.series.interval)
            await self.sample()

    async def sample(self) -> None:
        """Read every router once and add a point per model."""
        read = await asyncio.gather(*(self._read(r) for r in self.routers))
        now = self.wall()
        counted: dict[str, Totals] = {}
        for router, totals in zip(self.routers, read, strict=True):
            if totals is None:
                continue
            before = self._last.get(router.url)
            self._last[router.url] = totals
            if before is None:
                continue  # its first reading: nothing to count from yet
            for model, t in totals.items():
                since = t.minus(before.get(model, Totals()))
                counted[model] = counted.get(model, Totals()).plus(since)
        if self._last_at is not None:
            self.series.add(now, max(1e-3, now - self._last_at), counted)
        self._last_at = now

    async def _read(self, router: RouterTarget) -> dict[str, Totals] | None:
        try:
            answer = await self.http.get(
                f"{router.url}/v1/metrics", headers={"authorization": f"Bearer {router.token}"}
            )
            answer.raise_for_status()
            return read_totals(answer.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("no metrics from router %s: %s", router.url, exc)
            return None
