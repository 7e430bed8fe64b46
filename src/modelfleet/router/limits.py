"""Per-key limits: requests per minute, tokens per minute, requests in flight at once.

Requests per minute are exact: the times of a key's requests in the last 60 s are kept, and
one more is admitted only while fewer than the limit are. Tokens per minute are a sliding
window counted as two fixed one-minute buckets: what the previous bucket holds counts in
proportion to how much of it is still inside the last 60 s (the sliding-window counter of
Cloudflare and of the `limits` library); a log of every token is not worth keeping. Admission
checks every limit of the key and, only when all allow it, counts the request and reserves its
token estimate (prompt + `max_tokens`), so a burst of long requests cannot overshoot the token
limit before their usage is known. When the request ends its reservation is settled to the
tokens the engine reported (or to nothing, when no engine took it).

With one router the counters live in its memory (`MemoryLimits`). With several they live in
Redis (`RedisLimits`), which every router uses, so a key's limit is the same whatever the
number of routers. Each admission there is one Lua script, atomic on the server: check all
three limits, then count. The `limits` library (which also keeps its counters in Redis) has
no way to give back part of a reservation, and settling needs exactly that.

Requests in flight are members of a sorted set scored by a deadline, not a counter: a router
that dies holding some frees them at the deadline instead of never.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio

    from modelfleet.router.table import ApiKey

log = logging.getLogger("modelfleet.router")

WINDOW = 60.0  # seconds: "per minute"
IN_FLIGHT_DEADLINE = 3600.0  # a request still counted in flight after this was lost by a router


@dataclass(frozen=True)
class Refusal:
    """Why a request is over its key's limits, and when to try again."""

    limit: str  # "rpm", "tpm" or "max_concurrent"
    allowed: int
    retry_after: float  # seconds

    @property
    def retry_after_s(self) -> int:
        """Whole seconds for `Retry-After`, at least 1 (a hair of float error is no second)."""
        return max(1, math.ceil(self.retry_after - 1e-6))

    def message(self, key: str, cost: int) -> str:
        what = {
            "store": "its limits store is unreachable",
            "rpm": f"{self.allowed} requests per minute",
            "tpm": f"{self.allowed} tokens per minute",
            "max_concurrent": f"{self.allowed} requests at once",
        }[self.limit]
        if self.limit == "tpm" and cost > self.allowed:
            return (
                f"This request needs about {cost} tokens (prompt + max_tokens), more than the "
                f"{what} of key '{key}' ever allows: lower max_tokens."
            )
        return (
            f"Rate limit reached for key '{key}': {what} ({self.limit}). "
            f"Try again in {self.retry_after_s} s."
        )


@dataclass
class Ticket:
    """An admitted request: what it counted, to be settled when it ends."""

    key: str
    entry: str  # the admission's own name in the store
    tokens: int  # reserved
    bucket: int  # the minute bucket the tokens were counted in
    backed: bool = True  # False: admitted without the store (fail open); nothing to settle


class Limits(Protocol):
    """Where the counters live."""

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal: ...

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """The request ended: `tokens` it used (None: unknown, the reservation stands)."""
        ...

    async def close(self) -> None: ...


def bucket_of(now: float) -> tuple[int, float]:
    """The minute bucket `now` falls in, and the fraction of it elapsed."""
    bucket = math.floor(now / WINDOW)
    return bucket, now / WINDOW - bucket


def over(previous: float, current: float, cost: float, limit: int, elapsed: float) -> bool:
    """Whether `cost` more would go over `limit` in the sliding minute."""
    return previous * (1.0 - elapsed) + current + cost > limit


def retry_after(previous: float, current: float, cost: float, limit: int, elapsed: float) -> float:
    """Seconds until `cost` more fits in the sliding minute, if nothing else is counted."""
    room = limit - current - cost
    if room >= 0:  # fits once enough of the previous bucket has slid out
        need = 1.0 - room / previous if previous > 0 else elapsed
        return max(0.0, (need - elapsed) * WINDOW)
    # The current bucket alone is too full: wait for it to become the previous one.
    later = 1.0 - (limit - cost) / current if current > 0 else 0.0
    return (1.0 - elapsed) * WINDOW + max(0.0, later) * WINDOW


def _check(
    key: ApiKey,
    requests: Sequence[float],
    tokens: tuple[float, float],
    in_flight: int,
    cost: int,
    now: float,
) -> Refusal | None:
    """Which limit a request of `cost` tokens is over, given the times of the key's requests
    in the last minute (oldest first), its tokens in the previous and the current bucket, and
    its requests in flight; None when it fits."""
    if key.max_concurrent is not None and in_flight >= key.max_concurrent:
        return Refusal("max_concurrent", key.max_concurrent, 1.0)
    if key.rpm is not None and len(requests) >= key.rpm:
        # Room for one more once all but rpm - 1 of them are over a minute old.
        frees = requests[len(requests) - key.rpm]
        return Refusal("rpm", key.rpm, frees + WINDOW - now)
    if key.tpm is not None:
        elapsed = bucket_of(now)[1]
        previous, current = tokens
        if cost > key.tpm:
            return Refusal("tpm", key.tpm, WINDOW)
        if over(previous, current, cost, key.tpm, elapsed):
            return Refusal("tpm", key.tpm, retry_after(previous, current, cost, key.tpm, elapsed))
    return None


@dataclass
class _KeyCounts:
    requests: deque[float] = field(default_factory=deque)  # admission times, oldest first
    tokens: dict[int, int] = field(default_factory=dict)  # bucket -> tokens
    in_flight: int = 0


class MemoryLimits:
    """The counters in this router's memory: right for one router."""

    def __init__(self) -> None:
        self._keys: dict[str, _KeyCounts] = {}

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        counts = self._keys.setdefault(key.name, _KeyCounts())
        bucket = bucket_of(now)[0]
        while counts.requests and counts.requests[0] <= now - WINDOW:
            counts.requests.popleft()
        for old in [b for b in counts.tokens if b < bucket - 1]:
            del counts.tokens[old]
        buckets = (counts.tokens.get(bucket - 1, 0), counts.tokens.get(bucket, 0))
        refusal = _check(key, counts.requests, buckets, counts.in_flight, tokens, now)
        if refusal is not None:
            return refusal
        counts.requests.append(now)
        if key.tpm is not None:
            counts.tokens[bucket] = counts.tokens.get(bucket, 0) + tokens
        counts.in_flight += 1
        reserved = tokens if key.tpm is not None else 0
        return Ticket(key.name, _entry(request_id), reserved, bucket)

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        counts = self._keys.get(ticket.key)
        if counts is None:
            return
        counts.in_flight = max(0, counts.in_flight - 1)
        if ticket.tokens and tokens is not None and ticket.bucket in counts.tokens:
            counts.tokens[ticket.bucket] += tokens - ticket.tokens

    async def close(self) -> None:
        return None


def _entry(request_id: str) -> str:
    """A name for one admission, unique even when clients reuse their x-request-id."""
    return f"{request_id[:64]}/{random.getrandbits(64):016x}"


# KEYS: requests (sorted set: entry -> time), tokens of the previous bucket, of the current
# bucket, in flight (sorted set: entry -> deadline).
# ARGV: now, rpm, tpm, max_concurrent (0: none), tokens, entry, in-flight deadline,
# elapsed fraction of the current bucket.
# Answers {1} when admitted and counted, else {0, requests in the window as a list of times
# (only when over rpm), tokens previous, tokens current, in flight}.
_ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, elapsed = tonumber(ARGV[5]), tonumber(ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local requests = redis.call('ZCARD', KEYS[1])
local in_flight = redis.call('ZCARD', KEYS[4])
local t_prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local t_cur = tonumber(redis.call('GET', KEYS[3]) or '0')
local refused = (maxc > 0 and in_flight >= maxc) or (rpm > 0 and requests >= rpm)
  or (tpm > 0 and t_prev * (1 - elapsed) + t_cur + cost > tpm)
if refused then
  local times = {}
  if rpm > 0 and requests >= rpm then
    times = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  end
  return {0, times, tostring(t_prev), tostring(t_cur), in_flight}
end
redis.call('ZADD', KEYS[1], now, ARGV[6])
redis.call('EXPIRE', KEYS[1], 61)
if tpm > 0 then
  redis.call('INCRBY', KEYS[3], cost)
  redis.call('EXPIRE', KEYS[3], 121)
end
redis.call('ZADD', KEYS[4], ARGV[7], ARGV[6])
redis.call('EXPIRE', KEYS[4], math.ceil(tonumber(ARGV[7]) - now))
return {1}
"""

# KEYS: the tokens bucket the reservation went to, in flight. ARGV: tokens to add (negative:
# given back), the admission's entry.
_SETTLE = """
local delta = tonumber(ARGV[1])
if delta ~= 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('INCRBY', KEYS[1], delta)
end
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""


class RedisLimits:
    """The counters in Redis, shared by every router that names the same server.

    When Redis cannot be reached, `fail_open` says whether a request goes through unlimited
    (the default: an outage of the counters is no outage of the fleet) or is refused; either
    way it is logged, once per `log_every` seconds.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        fail_open: bool = True,
        prefix: str = "modelfleet:limits:",
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.fail_open = fail_open
        self.prefix = prefix
        self.log_every = log_every
        self.clock = clock
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._logged = -math.inf
        self.store_failures = 0  # requests admitted or refused without the store
        self._settling: list[tuple[list[str], list[str | int]]] = []
        self._flushing = False
        self._admitting: list[tuple[list[str], list[str | int | float], asyncio.Future[Any]]] = []
        self._admit_flusher: asyncio.Future[None] | None = None

    @classmethod
    def from_url(cls, url: str, fail_open: bool = True) -> RedisLimits:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=1.0, decode_responses=False
        )
        return cls(client, fail_open)

    def _key(self, name: str, what: str) -> str:
        return f"{self.prefix}{name}:{what}"

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        import redis.exceptions

        bucket, elapsed = bucket_of(now)
        entry = _entry(request_id)
        keys = [
            self._key(key.name, "requests"),
            self._key(key.name, f"tokens:{bucket - 1}"),
            self._key(key.name, f"tokens:{bucket}"),
            self._key(key.name, "in-flight"),
        ]
        args: list[str | int | float] = [
            repr(now),
            key.rpm or 0,
            key.tpm or 0,
            key.max_concurrent or 0,
            tokens,
            entry,
            repr(now + IN_FLIGHT_DEADLINE),
            repr(elapsed),
        ]
        try:
            answer = await self._admit_batched(keys, args)
        except (redis.exceptions.RedisError, OSError) as exc:
            return self._unbacked(key, request_id, exc)
        if answer[0] == 1:
            return Ticket(key.name, entry, tokens if key.tpm is not None else 0, bucket)
        times = [float(t) for t in answer[1][1::2]]
        counts = (float(answer[2]), float(answer[3]))
        refusal = _check(key, times, counts, int(answer[4]), tokens, now)
        # The script refused on the same counts, so _check names a limit; were the two ever
        # to disagree, the request is still refused, as the store decided.
        return refusal or Refusal("rpm", key.rpm or 0, 1.0)

    async def _admit_batched(self, keys: list[str], args: list[str | int | float]) -> Any:
        """The admission script's answer. Admissions that come in while a round trip is under
        way go together in the next one, as one pipeline; alone, one goes as it is."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._admitting.append((keys, args, future))
        if self._admit_flusher is None or self._admit_flusher.done():
            self._admit_flusher = asyncio.ensure_future(self._flush_admissions())
        return await future

    async def _flush_admissions(self) -> None:
        while self._admitting:
            batch, self._admitting = self._admitting, []
            try:
                if len(batch) == 1:
                    keys, args, _ = batch[0]
                    results: list[Any] = [await self._admit(keys=keys, args=args)]
                else:
                    pipe = self.client.pipeline(transaction=False)
                    for keys, args, _ in batch:
                        await self._admit(keys=keys, args=args, client=pipe)
                    results = await pipe.execute(raise_on_error=False)
            except BaseException as exc:  # the store failed the whole batch
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, _, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue  # its request was cancelled meanwhile
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """Settle in batches: the settlements that come in while one round trip is under
        way go together in the next, one pipeline, instead of a round trip each."""
        import redis.exceptions

        if not ticket.backed:
            return
        delta = 0 if tokens is None or not ticket.tokens else tokens - ticket.tokens
        keys = [
            self._key(ticket.key, f"tokens:{ticket.bucket}"),
            self._key(ticket.key, "in-flight"),
        ]
        self._settling.append((keys, [delta, ticket.entry]))
        if self._flushing:
            return  # the round trip under way takes this one with the next batch
        self._flushing = True
        try:
            while self._settling:
                batch, self._settling = self._settling, []
                pipe = self.client.pipeline(transaction=False)
                for batch_keys, args in batch:
                    await self._settle(keys=batch_keys, args=args, client=pipe)
                try:
                    await pipe.execute()
                except (redis.exceptions.RedisError, OSError) as exc:
                    self._log(f"cannot settle {len(batch)} request(s) in Redis: {exc}")
        finally:
            self._flushing = False

    def _unbacked(self, key: ApiKey, request_id: str, exc: Exception) -> Ticket | Refusal:
        self.store_failures += 1
        action = "letting requests through unlimited" if self.fail_open else "refusing them"
        self._log(f"the limits store is unreachable ({exc}); {action}")
        if self.fail_open:
            return Ticket(key.name, request_id, 0, 0, backed=False)
        return Refusal("store", 0, 1.0)

    def _log(self, message: str) -> None:
        now = self.clock()
        if now - self._logged >= self.log_every:
            self._logged = now
            log.warning("%s", message)

    async def close(self) -> None:
        await self.client.aclose()
