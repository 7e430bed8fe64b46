"""An engine's load as its Prometheus page states it: requests running plus requests waiting.

Each engine names these its own way; the first family that the page shows is used, summed over
its label sets (vLLM reports one per model and engine).
"""

from __future__ import annotations

import math

from modelfleet.engine_metrics import load_sources

# Every engine's gauges of requests running and waiting (the one mapping of engines' names).
_NAMES = load_sources()


def read_engine_load(page: str) -> int | None:
    """Requests running and waiting at the engine whose `/metrics` page is `page`; None when
    the page names none of the known gauges."""
    total = 0.0
    found = False
    for line in page.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if end < 0 or line[:end] not in _NAMES:
            continue
        rest = line[line.rfind("}") + 1 :] if line[end] == "{" else line[end:]
        try:
            number = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(number):
            total += number
            found = True
    return round(total) if found else None
