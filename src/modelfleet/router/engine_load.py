"""An engine's load as its Prometheus page states it: requests running plus requests waiting,
and the share of its KV cache in use; and its own histograms of the time to first token and
between tokens, which the router counts per model (`EngineTimes`) for the dashboard's plots.

Each engine names these its own way (`engine_metrics.py` holds the names): the requests are
summed over the page's label sets (vLLM reports one per model and engine), the cache's share
is the largest of them, a histogram's buckets are summed over them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelfleet.http.engine_metrics import cache_sources, load_sources, time_sources

# Every engine's gauges of requests running and waiting, and of its KV cache in use (the one
# mapping of engines' names).
_LOAD, _CACHE = load_sources(), cache_sources()
# Each engine histogram's buckets, by its name with `_bucket`: (time, its rank in the
# engines' names of that time, the first a page shows being taken).
_TIMES = {
    f"{source}_bucket": (time, rank)
    for time, sources in time_sources().items()
    for rank, source in enumerate(sources)
}
Buckets = Mapping[float, float]  # a histogram's cumulative counts by upper bound


def _bound(labels: str) -> float | None:
    """The `le` of a bucket sample's labels (`{le="0.5",model_name="m"}`)."""
    at = labels.find('le="')
    if at < 0:
        return None
    end = labels.find('"', at + 4)
    try:
        return float(labels[at + 4 : end])
    except ValueError:
        return None


@dataclass(frozen=True)
class EngineReading:
    """What one read of an engine's page says: its load (requests running and waiting) and
    the share of its KV cache in use; None where the page does not say."""

    load: int | None
    cache: float | None
    # The engine's histograms by the name the plots give them (`TIME_SIGNALS`): cumulative
    # counts by bound, summed over the page's label sets.
    times: Mapping[str, Buckets] = field(default_factory=dict)


def read_engine_page(page: str) -> EngineReading:
    """An engine's `/metrics` page, read once for its load and its cache."""
    load: list[float] = []
    cache: list[float] = []
    buckets: dict[tuple[str, int], dict[float, float]] = {}  # (time, rank) -> le -> count
    for line in page.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if end < 0:
            continue
        name = line[:end]
        histogram = _TIMES.get(name)
        into = load if name in _LOAD else cache if name in _CACHE else None
        if into is None and histogram is None:
            continue
        close = line.rfind("}")
        rest = line[close + 1 :] if line[end] == "{" else line[end:]
        try:
            number = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(number):
            continue
        if into is not None:
            into.append(number)
            continue
        bound = _bound(line[end:close]) if line[end] == "{" else None
        if histogram is not None and bound is not None:
            counts = buckets.setdefault(histogram, {})
            counts[bound] = counts.get(bound, 0.0) + number
    times: dict[str, dict[float, float]] = {}
    for (time, _), counts in sorted(buckets.items(), key=lambda kv: kv[0][1]):
        times.setdefault(time, counts)  # the first of the engines' names the page shows
    return EngineReading(
        load=round(sum(load)) if load else None,
        cache=min(1.0, max(0.0, max(cache))) if cache else None,
        times=times,
    )


class EngineTimes:
    """The engines' own histograms of time to first token and between tokens, counted per
    model as the router reads each engine: what an engine counted since the router's last
    reading of it is added to its model's counts (all it shows when its counts went down: it
    restarted); the first reading of an engine is where counting starts from. The counts
    only grow, as a counter's do."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], dict[float, float]] = {}  # (model, time) -> buckets
        self._last: dict[str, Mapping[str, Buckets]] = {}  # endpoint -> its last reading

    def take(self, endpoint: str, model: str | None, times: Mapping[str, Buckets]) -> None:
        """A reading of `endpoint`'s histograms, counted for `model` (None: in no model)."""
        before = self._last.get(endpoint)
        self._last[endpoint] = times
        if before is None or model is None:
            return
        for time, now in times.items():
            was = before.get(time, {})
            restarted = any(n < was.get(le, 0.0) for le, n in now.items())
            counts = self.counts.setdefault((model, time), {})
            for le, n in now.items():
                counts[le] = counts.get(le, 0.0) + n - (0.0 if restarted else was.get(le, 0.0))

    def keep_only(self, endpoints: set[str]) -> None:
        """Forget the readings of engines no longer routed to."""
        self._last = {e: t for e, t in self._last.items() if e in endpoints}


def read_engine_load(page: str) -> int | None:
    """Requests running and waiting at the engine whose `/metrics` page is `page`; None when
    the page names none of the known gauges."""
    return read_engine_page(page).load


def read_cache_usage(page: str) -> float | None:
    """The share of the engine's KV cache in use (0 to 1); None when its page does not say."""
    return read_engine_page(page).cache
