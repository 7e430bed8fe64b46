"""An engine's load as its Prometheus page states it: requests running plus requests waiting,
and the share of its KV cache in use.

Each engine names these its own way (`engine_metrics.py` holds the names): the requests are
summed over the page's label sets (vLLM reports one per model and engine), the cache's share
is the largest of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelfleet.http.engine_metrics import cache_sources, load_sources

# Every engine's gauges of requests running and waiting, and of its KV cache in use (the one
# mapping of engines' names).
_LOAD, _CACHE = load_sources(), cache_sources()


@dataclass(frozen=True)
class EngineReading:
    """What one read of an engine's page says: its load (requests running and waiting) and
    the share of its KV cache in use; None where the page does not say."""

    load: int | None
    cache: float | None


def read_engine_page(page: str) -> EngineReading:
    """An engine's `/metrics` page, read once for its load and its cache."""
    load: list[float] = []
    cache: list[float] = []
    for line in page.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if end < 0:
            continue
        name = line[:end]
        into = load if name in _LOAD else cache if name in _CACHE else None
        if into is None:
            continue
        rest = line[line.rfind("}") + 1 :] if line[end] == "{" else line[end:]
        try:
            number = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(number):
            into.append(number)
    return EngineReading(
        load=round(sum(load)) if load else None,
        cache=min(1.0, max(0.0, max(cache))) if cache else None,
    )


def read_engine_load(page: str) -> int | None:
    """Requests running and waiting at the engine whose `/metrics` page is `page`; None when
    the page names none of the known gauges."""
    return read_engine_page(page).load


def read_cache_usage(page: str) -> float | None:
    """The share of the engine's KV cache in use (0 to 1); None when its page does not say."""
    return read_engine_page(page).cache
