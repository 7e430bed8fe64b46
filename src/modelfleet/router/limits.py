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

Leases. A round trip to Redis per request doubled the router's added latency and CPU (the
benchmark's 1,000 limited keys), so for keys whose rate limits are large (every one of
`rpm` and `tpm` it has at least `LEASED_FROM` a minute) a router leases a share of the
key's allowance and admits from it in memory: at most 1/`LEASE_SHARE` of each limit, or what
the request needs when that is more. The store counts a lease as used when it grants it;
whatever a router does not use in the minute bucket it was leased in goes back to the store
when the bucket ends, and a request's tokens settle into the lease. At the first admission of
a new minute, every key the router admitted requests for in the last one leases a share for
the new one, a hundred keys to a pipeline; until a key's new lease lands, what was left of
its last one admits its requests (counted in the last minute, which at the turn still
weighs in whole), and then goes back. A key in steady use never waits for its lease. What a
lease changes:
- requests per minute of such a key are counted like tokens, as the sliding two-bucket
  window, instead of exactly;
- what routers hold unused can refuse a request early, by up to one share per router; it
  never lets one more through;
- requests in flight are leased as slots. A router keeps at most one share of unused slots
  and gives the rest back as its requests end. Under 100 requests at once a share is zero
  and every slot is taken and given back with its request, which is exact.
Keys with smaller rate limits (60 a minute, say) are counted exactly, one script per
request, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
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
# A router leases at most this share of a key's limit at a time (`RedisLimits`): 1/100.
LEASE_SHARE = 100
# Requests or tokens per minute from which a limit is leased rather than counted exactly.
LEASED_FROM = 2 * LEASE_SHARE
# Leases renewed (or given back) together in one pipeline at most, one pipeline after the
# other. Building and reading a pipeline of a thousand scripts held the event loop for about
# 30 ms; ten pipelines of a hundred, sent at once, for 16 to 22 ms (a minute's turn with
# 1,000 keys, measured): every request that came meanwhile waited that long.
RENEW_BATCH = 25


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
    leased: bool = False  # admitted from a lease (`RedisLimits`); `entry` names its holder


class Limits(Protocol):
    """Where the counters live."""

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal: ...

    def admit_at_once(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal | None:
        """Admit without waiting when no round trip is needed (in memory, from a lease);
        None when `admit` must be awaited instead."""
        ...

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """The request ended: `tokens` it used (None: unknown, the reservation stands)."""
        ...

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        """Settle without waiting when no round trip is needed (in memory, into a lease);
        False when `settle` must be awaited instead."""
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
        return self.admit_at_once(key, tokens, request_id, now)

    def admit_at_once(
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
        self.settle_at_once(ticket, tokens, now)

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        counts = self._keys.get(ticket.key)
        if counts is None:
            return True
        counts.in_flight = max(0, counts.in_flight - 1)
        if ticket.tokens and tokens is not None and ticket.bucket in counts.tokens:
            counts.tokens[ticket.bucket] += tokens - ticket.tokens
        return True

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

# Leases (see the module's docstring). KEYS: requests of the previous bucket, of the current
# bucket, tokens of the previous bucket, of the current bucket, slots held (hash: router ->
# slots), the holders' deadlines (sorted set: router -> deadline).
# ARGV: now, elapsed fraction of the bucket, rpm, tpm, max_concurrent (0: none), then for
# requests, tokens and slots each what the router wants and what it needs at least, then
# the router's name and its deadline.
# Grants all of what is wanted that fits, or nothing when a need does not fit. Answers
# {granted requests, tokens, slots, the limit that refused (0: none; 1 rpm, 2 tpm, 3 slots),
# requests previous, requests current, tokens previous, tokens current, slots held by all}.
_LEASE = """
local now, elapsed = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, tpm, maxc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local want_r, need_r = tonumber(ARGV[6]), tonumber(ARGV[7])
local want_t, need_t = tonumber(ARGV[8]), tonumber(ARGV[9])
local want_s, need_s = tonumber(ARGV[10]), tonumber(ARGV[11])
local r_prev = tonumber(redis.call('GET', KEYS[1]) or '0')
local r_cur = tonumber(redis.call('GET', KEYS[2]) or '0')
local t_prev = tonumber(redis.call('GET', KEYS[3]) or '0')
local t_cur = tonumber(redis.call('GET', KEYS[4]) or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now)
for _, holder in ipairs(gone) do redis.call('HDEL', KEYS[5], holder) end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
local held = 0
for _, n in ipairs(redis.call('HVALS', KEYS[5])) do held = held + tonumber(n) end
local function room(limit, prev, cur)
  return math.floor(limit - (prev * (1 - elapsed) + cur))
end
local g_r, g_t, g_s, refused = 0, 0, 0, 0
if need_r > 0 then
  local r = room(rpm, r_prev, r_cur)
  if r < need_r then refused = 1 else g_r = math.min(want_r, r) end
end
if refused == 0 and need_t > 0 then
  local r = room(tpm, t_prev, t_cur)
  if r < need_t then refused = 2 else g_t = math.min(want_t, r) end
end
if refused == 0 and need_s > 0 then
  local r = maxc - held
  if r < need_s then refused = 3 else g_s = math.min(want_s, r) end
end
if refused ~= 0 then
  return {0, 0, 0, refused, tostring(r_prev), tostring(r_cur), tostring(t_prev),
          tostring(t_cur), held}
end
if g_r > 0 then
  redis.call('INCRBY', KEYS[2], g_r)
  redis.call('EXPIRE', KEYS[2], 121)
end
if g_t > 0 then
  redis.call('INCRBY', KEYS[4], g_t)
  redis.call('EXPIRE', KEYS[4], 121)
end
if g_s > 0 then
  redis.call('HINCRBY', KEYS[5], ARGV[12], g_s)
  redis.call('ZADD', KEYS[6], ARGV[13], ARGV[12])
  redis.call('EXPIRE', KEYS[5], math.ceil(tonumber(ARGV[13]) - now))
  redis.call('EXPIRE', KEYS[6], math.ceil(tonumber(ARGV[13]) - now))
end
return {g_r, g_t, g_s, 0, tostring(r_prev), tostring(r_cur), tostring(t_prev),
        tostring(t_cur), held + g_s}
"""

# What a router gives back of its lease. KEYS: requests of the lease's bucket, its tokens,
# slots held. ARGV: requests, tokens (negative: used beyond the lease), slots, the router.
_GIVE_BACK = """
local r, t, s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if r ~= 0 and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], r) end
if t ~= 0 and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DECRBY', KEYS[2], t) end
if s > 0 then
  local left = redis.call('HINCRBY', KEYS[3], ARGV[4], -s)
  if left <= 0 then redis.call('HDEL', KEYS[3], ARGV[4]) end
end
return 1
"""


@dataclass
class _Lease:
    """What one router holds of one key's allowance."""

    key: ApiKey | None = None  # the key as last seen, with its limits
    bucket: int = -1  # the minute bucket `requests` and `tokens` were leased in
    used: bool = False  # whether it admitted a request in that bucket
    requests: int = 0  # left to admit
    tokens: int = 0  # left to reserve; negative when requests used more than they reserved
    slots: int = 0  # requests in flight it may have
    in_flight: int = 0
    slot_share: int = 0  # unused slots it keeps: a share of the key's max_concurrent
    fetching: asyncio.Future[Refusal | None] | None = None  # a lease asked for, unanswered
    # While its lease for a new minute is being renewed, what is left of the last minute's
    # lease still admits requests (counted in that minute, where the store counted them).
    carry_bucket: int = -1  # -1: none
    carry_requests: int = 0
    carry_tokens: int = 0


def _share(limit: int | None) -> int:
    return 0 if limit is None else limit // LEASE_SHARE


def _limits(key: ApiKey) -> tuple[int | None, int | None, int | None]:
    return key.rpm, key.tpm, key.max_concurrent


def leased(key: ApiKey) -> bool:
    """Whether `key`'s limits are leased by routers rather than counted per request."""
    return (key.rpm is None or key.rpm >= LEASED_FROM) and (
        key.tpm is None or key.tpm >= LEASED_FROM
    )


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
        self._lease = client.register_script(_LEASE)
        self._give_back = client.register_script(_GIVE_BACK)
        self.name = f"router-{random.getrandbits(64):016x}"  # the holder of this one's leases
        self._leases: dict[str, _Lease] = {}
        self._bucket = -1  # the latest minute bucket an admission was made in
        self._returning: list[tuple[list[str], list[str | int]]] = []
        self._return_flusher: asyncio.Future[None] | None = None
        self.leases_taken = 0  # round trips for leases: a figure for tests and the benchmark

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

        if leased(key):
            return await self._admit_leased(key, tokens, now)
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

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        if not ticket.backed:
            return True
        if ticket.leased and ticket.entry == self.name:
            self._settle_leased(ticket, tokens)  # give-backs, if any, go in the background
            return True
        return False

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """Settle in batches: the settlements that come in while one round trip is under
        way go together in the next, one pipeline, instead of a round trip each."""
        import redis.exceptions

        if not ticket.backed:
            return
        if ticket.leased:
            self._settle_leased(ticket, tokens)
            if self._return_flusher is not None and not self._return_flusher.done():
                await asyncio.shield(self._return_flusher)  # what it gave back is counted
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
                try:
                    await self._pipelined(self._settle, batch)
                except (redis.exceptions.RedisError, OSError) as exc:
                    self._log(f"cannot settle {len(batch)} request(s) in Redis: {exc}")
        finally:
            self._flushing = False

    # -- leases ----------------------------------------------------------------------------

    def _lease_keys(self, name: str, bucket: int) -> list[str]:
        return [
            self._key(name, f"lease-requests:{bucket - 1}"),
            self._key(name, f"lease-requests:{bucket}"),
            self._key(name, f"lease-tokens:{bucket - 1}"),
            self._key(name, f"lease-tokens:{bucket}"),
            self._key(name, "lease-slots"),
            self._key(name, "lease-holders"),
        ]

    def _lease_args(
        self,
        key: ApiKey,
        now: float,
        requests: tuple[int, int],
        tokens: tuple[int, int],
        slots: tuple[int, int],
    ) -> list[str | int]:
        """The lease script's ARGV: for requests, tokens and slots, (wanted, needed)."""
        elapsed = bucket_of(now)[1]
        limits = [key.rpm or 0, key.tpm or 0, key.max_concurrent or 0]
        return [repr(now), repr(elapsed), *limits, *requests, *tokens, *slots, self.name,
                repr(now + IN_FLIGHT_DEADLINE)]  # fmt: skip

    async def _pipelined(self, script: Any, batch: list[tuple[list[str], list[Any]]]) -> None:
        """Run `script` once per (keys, args) of `batch`, in one pipeline: one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for keys, args in batch:
            await script(keys=keys, args=args, client=pipe)
        await pipe.execute()

    def admit_at_once(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal | None:
        if not leased(key):
            return None  # one script per request
        if key.tpm is not None and tokens > key.tpm:
            return Refusal("tpm", key.tpm, WINDOW)
        got = self._from_lease(key, self._lease_of(key), tokens, now)
        return got if isinstance(got, Ticket) else None

    def _lease_of(self, key: ApiKey) -> _Lease:
        lease = self._leases.get(key.name)
        if lease is None:
            lease = self._leases[key.name] = _Lease()
        elif lease.key is not key and lease.key is not None and _limits(lease.key) != _limits(key):
            self._drop(key.name, lease)  # leased under other limits: they hold no more
        lease.key = key
        lease.slot_share = _share(key.max_concurrent)
        return lease

    def _from_lease(
        self, key: ApiKey, lease: _Lease, tokens: int, now: float
    ) -> Ticket | tuple[int, int, int]:
        """Admit from what `lease` holds (or carries from last minute), or say what it is
        short of: requests, tokens, slots."""
        bucket = bucket_of(now)[0]
        if bucket > self._bucket:
            self._turn(bucket, now)
        if lease.bucket != bucket:
            self._roll(key.name, lease, bucket)
        short_r = max(0, 1 - lease.requests) if key.rpm is not None else 0
        short_t = max(0, tokens - lease.tokens) if key.tpm is not None else 0
        short_s = max(0, lease.in_flight + 1 - lease.slots) if key.max_concurrent else 0
        reserved = tokens if key.tpm is not None else 0
        if not (short_r or short_t or short_s):
            lease.used = True
            lease.requests -= 1 if key.rpm is not None else 0
            lease.tokens -= reserved
            lease.in_flight += 1
            return Ticket(key.name, self.name, reserved, bucket, leased=True)
        if lease.carry_bucket >= 0 and not short_s:
            enough_r = key.rpm is None or lease.carry_requests >= 1
            enough_t = key.tpm is None or lease.carry_tokens >= tokens
            if enough_r and enough_t:
                lease.used = True
                lease.carry_requests -= 1 if key.rpm is not None else 0
                lease.carry_tokens -= reserved
                lease.in_flight += 1
                return Ticket(key.name, self.name, reserved, lease.carry_bucket, leased=True)
        return short_r, short_t, short_s

    async def _admit_leased(self, key: ApiKey, tokens: int, now: float) -> Ticket | Refusal:
        """Admit from this router's lease of `key`, leasing more from the store only when it
        falls short: most admissions never wait."""
        import redis.exceptions

        if key.tpm is not None and tokens > key.tpm:
            return Refusal("tpm", key.tpm, WINDOW)
        lease = self._lease_of(key)
        while True:
            got = self._from_lease(key, lease, tokens, now)
            if isinstance(got, Ticket):
                return got
            short_r, short_t, short_s = got
            fetching = lease.fetching
            mine = fetching is None
            if fetching is None:
                # A task of its own, so that a grant is recorded even when the request that
                # asked for it is cancelled meanwhile (its client gone).
                fetching = lease.fetching = asyncio.ensure_future(
                    self._fetch(key, lease, (short_r, short_t, short_s), tokens, now)
                )
            try:
                refusal = await asyncio.shield(fetching)
            except (redis.exceptions.RedisError, OSError) as exc:
                return self._unbacked(key, self.name, exc)
            if refusal is not None and mine:
                return refusal
            # Another request's lease came: look again whether it brought enough.

    async def _fetch(
        self, key: ApiKey, lease: _Lease, shorts: tuple[int, int, int], tokens: int, now: float
    ) -> Refusal | None:
        """Lease what `shorts` says is missing (requests, tokens, slots), at least a share of
        each limit; record what is granted. Returns why the store refused, or None."""
        short_r, short_t, short_s = shorts
        bucket, elapsed = bucket_of(now)
        try:
            if self._return_flusher is not None and not self._return_flusher.done():
                # What this router gives back counts before what it asks for.
                await asyncio.shield(self._return_flusher)
            answer = await self._lease(
                keys=self._lease_keys(key.name, bucket),
                args=self._lease_args(
                    key,
                    now,
                    (max(short_r, _share(key.rpm)) if short_r else 0, short_r),
                    (max(short_t, _share(key.tpm)) if short_t else 0, short_t),
                    (max(short_s, lease.slot_share) if short_s else 0, short_s),
                ),
            )
        finally:
            lease.fetching = None
        self.leases_taken += 1
        granted_r, granted_t, granted_s, refused = (int(v) for v in answer[:4])
        if refused:
            r_prev, r_cur, t_prev, t_cur = (float(v) for v in answer[4:8])
            if refused == 1:
                wait = retry_after(r_prev, r_cur, 1, key.rpm or 0, elapsed)
                return Refusal("rpm", key.rpm or 0, wait)
            if refused == 2:
                wait = retry_after(t_prev, t_cur, tokens, key.tpm or 0, elapsed)
                return Refusal("tpm", key.tpm or 0, wait)
            return Refusal("max_concurrent", key.max_concurrent or 0, 1.0)
        if lease.bucket == bucket:
            lease.requests += granted_r
            lease.tokens += granted_t
        else:  # the bucket turned meanwhile: what was granted goes back to its bucket
            self._give(key.name, bucket, granted_r, granted_t, 0)
        lease.slots += granted_s
        return None

    def _turn(self, bucket: int, now: float) -> None:
        """The first admission in a new minute bucket: the keys that admitted requests in the
        last one lease a share for this one, in pipelines of `RENEW_BATCH`, so that their
        next requests find a lease instead of waiting for one each. Until a key's renewal
        lands, what was left of its last lease admits its requests."""
        self._bucket = bucket
        renewing = [
            (name, lease)
            for name, lease in self._leases.items()
            if lease.used
            and lease.bucket == bucket - 1
            and lease.fetching is None
            and lease.key is not None
            and (lease.key.rpm is not None or lease.key.tpm is not None)
        ]
        carried = {id(lease) for _, lease in renewing}
        for name, lease in list(self._leases.items()):
            if lease.bucket < bucket:
                idle = (
                    lease.bucket >= 0  # not one just made for the admission under way
                    and not lease.used
                    and not lease.in_flight
                    and lease.fetching is None
                )
                self._roll(name, lease, bucket, carry=id(lease) in carried)
                if idle and not lease.slots:
                    del self._leases[name]  # unused for a minute: forgotten, nothing held
        previous: asyncio.Future[Refusal | None] | None = None
        for start in range(0, len(renewing), RENEW_BATCH):
            batch = renewing[start : start + RENEW_BATCH]
            task = asyncio.ensure_future(self._renew_after(previous, batch, now))
            for _, lease in batch:
                lease.fetching = task
            previous = task

    async def _renew_after(
        self,
        previous: asyncio.Future[Refusal | None] | None,
        renewing: list[tuple[str, _Lease]],
        now: float,
    ) -> Refusal | None:
        """Renew once the batch before has been renewed: one pipeline at a time."""
        if previous is not None:
            await asyncio.wait([previous])
        return await self._renew(renewing, now)

    async def _renew(self, renewing: list[tuple[str, _Lease]], now: float) -> Refusal | None:
        import redis.exceptions

        bucket = bucket_of(now)[0]
        answers: list[Any] = []
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, lease in renewing:
                key = lease.key
                assert key is not None
                share_r, share_t = _share(key.rpm), _share(key.tpm)
                await self._lease(
                    keys=self._lease_keys(name, bucket),
                    args=self._lease_args(
                        key, now, (share_r, min(share_r, 1)), (share_t, min(share_t, 1)), (0, 0)
                    ),
                    client=pipe,
                )
            answers = await pipe.execute(raise_on_error=False)
            self.leases_taken += 1
        except (redis.exceptions.RedisError, OSError) as exc:
            self._log(f"cannot renew {len(renewing)} lease(s) in Redis: {exc}")
            answers = [exc] * len(renewing)  # each key's next request asks for itself
        finally:
            for _, lease in renewing:
                lease.fetching = None
        for (name, lease), answer in zip(renewing, answers, strict=True):
            self._end_carry(name, lease)
            if isinstance(answer, Exception) or int(answer[3]):
                continue  # refused, or failed: the key's next request asks for itself
            if lease.bucket == bucket:
                lease.requests += int(answer[0])
                lease.tokens += int(answer[1])
            else:
                self._give(name, bucket, int(answer[0]), int(answer[1]), 0)
        return None

    def _end_carry(self, name: str, lease: _Lease) -> None:
        """The renewal landed (or failed): what is left of the last minute goes back."""
        if lease.carry_bucket >= 0:
            self._give(name, lease.carry_bucket, lease.carry_requests, lease.carry_tokens, 0)
        lease.carry_bucket, lease.carry_requests, lease.carry_tokens = -1, 0, 0

    def _drop(self, name: str, lease: _Lease) -> None:
        """Give back all of a lease but the slots of requests still in flight."""
        self._end_carry(name, lease)
        if lease.bucket >= 0:
            surplus = max(0, lease.slots - lease.in_flight)
            self._give(name, lease.bucket, lease.requests, lease.tokens, surplus)
            lease.slots -= surplus
        lease.requests = lease.tokens = 0

    def _roll(self, name: str, lease: _Lease, bucket: int, carry: bool = False) -> None:
        """A new minute bucket: what is left of the last one's lease goes back to it, or,
        with `carry`, is kept to admit requests until the new lease comes."""
        self._end_carry(name, lease)
        if carry and lease.bucket >= 0:
            lease.carry_bucket = lease.bucket
            lease.carry_requests, lease.carry_tokens = lease.requests, lease.tokens
        elif lease.bucket >= 0 and (lease.requests or lease.tokens):
            self._give(name, lease.bucket, lease.requests, lease.tokens, 0)
        lease.used = False
        lease.bucket, lease.requests, lease.tokens = bucket, 0, 0

    def _settle_leased(self, ticket: Ticket, tokens: int | None) -> None:
        """A leased request ended: its slot and its unused tokens go back to the lease."""
        lease = self._leases.get(ticket.key)
        unused = ticket.tokens - tokens if tokens is not None and ticket.tokens else 0
        if lease is None or ticket.entry != self.name:
            # Another router's ticket (only tests settle one here): straight to the store.
            self._give(ticket.key, ticket.bucket, 0, unused, 1, holder=ticket.entry)
            return
        lease.in_flight = max(0, lease.in_flight - 1)
        if unused:
            if ticket.bucket == lease.bucket:
                lease.tokens += unused
            elif ticket.bucket == lease.carry_bucket:
                lease.carry_tokens += unused
            else:
                self._give(ticket.key, ticket.bucket, 0, unused, 0)
        keep = lease.in_flight + lease.slot_share
        if lease.slots > keep:
            self._give(ticket.key, ticket.bucket, 0, 0, lease.slots - keep)
            lease.slots = keep

    def _give(
        self, name: str, bucket: int, requests: int, tokens: int, slots: int, holder: str = ""
    ) -> None:
        """Give back to the store, in the background: gives that come while one round trip
        is under way go together in the next, one pipeline."""
        keys = self._lease_keys(name, bucket)
        self._returning.append(
            ([keys[1], keys[3], keys[4]], [requests, tokens, slots, holder or self.name])
        )
        if self._return_flusher is None or self._return_flusher.done():
            self._return_flusher = asyncio.ensure_future(self._flush_returns())

    async def _flush_returns(self) -> None:
        import redis.exceptions

        while self._returning:
            batch = self._returning[:RENEW_BATCH]
            del self._returning[:RENEW_BATCH]
            try:
                await self._pipelined(self._give_back, batch)
            except (redis.exceptions.RedisError, OSError) as exc:
                self._log(f"cannot give back {len(batch)} lease(s) to Redis: {exc}")

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
        """Give back what this router holds of every lease (for at most 2 s), then close."""
        for name, lease in self._leases.items():
            self._end_carry(name, lease)
            if lease.bucket >= 0:
                self._give(name, lease.bucket, lease.requests, lease.tokens, lease.slots)
        if self._return_flusher is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._return_flusher), 2)
        await self.client.aclose()
