"""An engine's load as its Prometheus page states it: requests running plus requests waiting,
and the share of its KV cache in use.

Each engine names these its own way (`engine_metrics.py` holds the names): the requests are
summed over the page's label sets (vLLM reports one per model and engine), the cache's share
is the largest of them.
"""

from __future__ import annotations

import math

from modelfleet.engine_metrics import cache_sources, load_sources

# Every engine's gauges of requests running and waiting, and of its KV cache in use (the one
# mapping of engines' names).
_LOAD, _CACHE = load_sources(), cache_sources()


def _values(page: str, names: frozenset[str]) -> list[float]:
    """The finite values of the samples of `page` whose metric is one of `names`."""
    found = []
    for line in page.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if end < 0 or line[:end] not in names:
            continue
        rest = line[line.rfind("}") + 1 :] if line[end] == "{" else line[end:]
        try:
            number = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(number):
            found.append(number)
    return found


def read_engine_load(page: str) -> int | None:
    """Requests running and waiting at the engine whose `/metrics` page is `page`; None when
    the page names none of the known gauges."""
    found = _values(page, _LOAD)
    return round(sum(found)) if found else None


def read_cache_usage(page: str) -> float | None:
    """The share of the engine's KV cache in use (0 to 1); None when its page does not say."""
    found = _values(page, _CACHE)
    return min(1.0, max(0.0, max(found))) if found else None
