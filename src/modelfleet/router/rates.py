"""How often each LoRA adapter was asked for lately, as a rate that fades: what the control
plane weighs when it decides which adapters each replica holds (`residency.py`)."""

from __future__ import annotations

import math

FADE_S = 30.0  # a request counts e^-1 after this long


class Rates:
    """Requests per second per name, exponentially weighted over about `fade` seconds."""

    def __init__(self, fade: float = FADE_S) -> None:
        self.fade = fade
        self._seen: dict[str, tuple[float, float]] = {}  # name -> (weight, at)

    def note(self, name: str, now: float) -> None:
        """One request for `name` at `now`."""
        weight, at = self._seen.get(name, (0.0, now))
        self._seen[name] = (weight * math.exp((at - now) / self.fade) + 1.0, now)

    def rates(self, now: float) -> dict[str, float]:
        """Requests per second lately, per name (those faded to nothing are forgotten)."""
        out = {}
        for name, (weight, at) in list(self._seen.items()):
            left = weight * math.exp((at - now) / self.fade)
            if left < 0.01:
                del self._seen[name]
                continue
            out[name] = left / self.fade
        return out
