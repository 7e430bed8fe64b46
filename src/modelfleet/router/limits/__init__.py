"""Per-key limits: requests per minute, tokens per minute, requests in flight at once.

Admission checks every limit of a key and, only when all allow it, counts the request and
reserves the most tokens it can cost (`core/token_bound.py`), so that a burst of requests
cannot overshoot a token limit before their usage is known; when the request ends its
reservation is settled to the tokens the engine reported (`base.py`). What "per minute"
means, and why no 60 s window ever holds more than the limit, is `window.py`. The counts
live in one router's memory (`memory.py`) or in a Redis server every router shares
(`shared.py`): counted one request at a time for small limits (`exact.py`), leased in shares
for large ones (`leases.py`), through one connection with a clock and a breaker
(`store.py`).
"""

from modelfleet.router.limits.base import Limits, Ticket
from modelfleet.router.limits.exact import RENEW_EVERY, SLOT_TTL
from modelfleet.router.limits.leases import LEASE_SHARE, LEASED_FROM, leased
from modelfleet.router.limits.memory import MemoryLimits
from modelfleet.router.limits.shared import RedisLimits
from modelfleet.router.limits.window import SLICE, WINDOW, Refusal

__all__ = [
    "LEASED_FROM",
    "LEASE_SHARE",
    "RENEW_EVERY",
    "SLICE",
    "SLOT_TTL",
    "WINDOW",
    "Limits",
    "MemoryLimits",
    "RedisLimits",
    "Refusal",
    "Ticket",
    "leased",
]
