"""The routers' numbers over the last hour, per model: what the dashboard plots.

Every `interval` the control plane reads each router's metrics (through its push API, which
answers the sum over the router's workers), sums them over the routers, and keeps per model
one point per interval: requests, server errors and refusals per second, completion tokens
per second, and the 50th, 95th and 99th percentiles of the time to first byte, the time
between tokens (streams) and the request time of the requests engines answered in that
interval, worked out from the histograms' buckets as Prometheus's `histogram_quantile` does.
An error is a request sent to an engine that got a 5xx; a refusal, one the router answered
itself (no key, a key over its limit, no replica ready...): two lines, so that 31 % refused
no longer shows as no errors, nor refusals as the engines' failures. A router that
restarted (its counters went down) counts from zero again; one that does not answer is left
out of that point. Memory: one hour of points per model, whatever the traffic.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.controlplane.config import RouterTarget

log = logging.getLogger("modelfleet.controlplane")

KEEP_S = 3600.0
QUANTILES = (0.5, 0.95, 0.99)
# The routers' histograms a point reads percentiles of, by the name a point gives them.
TIMES = {
    "first_byte": "modelfleet_router_first_byte_seconds",
    "inter_token": "modelfleet_router_inter_token_seconds",
    "request": "modelfleet_router_request_seconds",
}


@dataclass(frozen=True)
class Point:
    """One interval's numbers of one model, summed over the routers."""

    at: float  # wall-clock time at its end
    requests_per_s: float
    errors_per_s: float  # requests sent to an engine, answered with a 5xx status
    refusals_per_s: float  # requests the router answered itself
    tokens_per_s: float = 0.0  # completion tokens
    # "first_byte_p50" ... "request_p99", in seconds; None: no request in the interval
    times: Mapping[str, float | None] = field(default_factory=dict)


@dataclass
class Totals:
    """A router's counters of one model, as read: by name ("requests", "errors", "refusals",
    "tokens"), and each histogram's cumulative buckets as (time name, bound)."""

    counts: dict[str, float] = field(default_factory=dict)
    buckets: dict[tuple[str, float], float] = field(default_factory=dict)

    def count(self, name: str) -> float:
        return self.counts.get(name, 0.0)

    def add(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def minus(self, earlier: Totals) -> Totals:
        """What was counted since `earlier`; all of it when a counter went down (a restart)."""
        went_down = any(v < earlier.counts.get(k, 0.0) for k, v in self.counts.items()) or any(
            v < earlier.buckets.get(k, 0.0) for k, v in self.buckets.items()
        )
        if went_down:
            return self
        return Totals(
            {k: v - earlier.counts.get(k, 0.0) for k, v in self.counts.items()},
            {k: v - earlier.buckets.get(k, 0.0) for k, v in self.buckets.items()},
        )

    def plus(self, other: Totals) -> Totals:
        counts, buckets = dict(self.counts), dict(self.buckets)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        for b, v in other.buckets.items():
            buckets[b] = buckets.get(b, 0.0) + v
        return Totals(counts, buckets)

    def quantile(self, time: str, q: float) -> float | None:
        """The `q` quantile of histogram `time`, by linear interpolation inside the bucket it
        falls in (the last finite bound when in +Inf); None with no observation."""
        bounds = sorted((le, n) for (name, le), n in self.buckets.items() if name == time)
        if not bounds or bounds[-1][1] <= 0:
            return None
        rank = q * bounds[-1][1]
        below_le, below_n = 0.0, 0.0
        for le, n in bounds:
            if n >= rank:
                if math.isinf(le):
                    return below_le
                if n == below_n:
                    return le
                return below_le + (le - below_le) * (rank - below_n) / (n - below_n)
            below_le, below_n = le, n
        return below_le


def read_totals(text: str) -> dict[str, Totals]:
    """A router's metrics page, as counters per model."""
    out: dict[str, Totals] = {}
    histograms = {f"{family}_bucket": time for time, family in TIMES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            t = out.setdefault(model, Totals())
            name, status = sample.name, sample.labels.get("status", "")
            if name == "modelfleet_router_requests_total":
                t.add("requests", sample.value)
                if status.startswith("5"):
                    t.add("errors", sample.value)
            elif name == "modelfleet_router_refusals_total":
                t.add("refusals", sample.value)
                if status.startswith("5"):
                    t.add("errors", -sample.value)  # the router's own 503, not an engine's
            elif name == "modelfleet_router_tokens_total":
                if sample.labels.get("kind") == "completion":
                    t.add("tokens", sample.value)
            elif name in histograms:
                bound = float(sample.labels["le"])
                key = (histograms[name], bound)
                t.buckets[key] = t.buckets.get(key, 0.0) + sample.value
    return out


@dataclass
class Series:
    """The points of every model, an hour of them each."""

    interval: float
    points: dict[str, deque[Point]] = field(default_factory=dict)

    def add(self, at: float, seconds: float, counted: dict[str, Totals]) -> None:
        keep = max(2, int(KEEP_S / self.interval))
        for model, t in counted.items():
            times = {
                f"{time}_p{round(q * 100)}": t.quantile(time, q)
                for time in TIMES
                for q in QUANTILES
            }
            self.points.setdefault(model, deque(maxlen=keep)).append(
                Point(
                    at=at,
                    requests_per_s=t.count("requests") / seconds,
                    errors_per_s=t.count("errors") / seconds,
                    refusals_per_s=t.count("refusals") / seconds,
                    tokens_per_s=t.count("tokens") / seconds,
                    times=times,
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
