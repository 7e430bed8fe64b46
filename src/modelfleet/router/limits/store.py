"""The Redis server routers share their keys' counts in: the scripts that count there, the
clock they count by, and a breaker that stops asking a server that does not answer.

- **One clock.** Routers' clocks differ (a 5 s skew once let a key through 1.5 times its
  limit): every time sent to Redis is the router's wall clock corrected by an offset learned
  from Redis' own `TIME`, taken again every `SYNC_EVERY` seconds.
- **A breaker.** After `OPEN_AFTER` failures in a row (a timeout, a refused connection) the
  server is taken as unreachable: calls fail at once, without a round trip, and the limits
  act as `limits_fail` says, until a background `PING` is answered. A hung Redis once added
  a second to every request.
- **A stale connection is tried once more.** After a restart of Redis a pooled connection is
  dead; a command sent on it fails to send, and goes again on a new one. A timeout is not
  tried again: the breaker counts it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from modelfleet.router.limits.window import SLICE, SLICES, WINDOW

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("modelfleet.router")

OPEN_AFTER = 3  # failures in a row after which the server is taken as unreachable
PROBE_EVERY = 1.0  # seconds between probes of an unreachable server
SYNC_EVERY = 30.0  # seconds between readings of Redis' clock
TIMEOUT = 0.5  # seconds a command may take before it counts as a failure


class StoreUnavailable(Exception):
    """The limits store did not answer (or is taken as unreachable). `sent`: the command may
    have reached it all the same (a timeout), so it may have counted."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class Breaker:
    """Opens after `open_after` failures in a row; a success closes it."""

    def __init__(self, clock: Callable[[], float], open_after: int = OPEN_AFTER) -> None:
        self.clock = clock
        self.open_after = open_after
        self.failures = 0
        self.opened_at: float | None = None

    @property
    def open(self) -> bool:
        return self.opened_at is not None

    def failed(self) -> bool:
        """Count a failure; True when it opens the breaker."""
        self.failures += 1
        if self.opened_at is None and self.failures >= self.open_after:
            self.opened_at = self.clock()
            return True
        return False

    def succeeded(self) -> bool:
        """Count a success; True when it closes the breaker."""
        self.failures = 0
        was_open = self.opened_at is not None
        self.opened_at = None
        return was_open


# Lua shared by the scripts. A key's counts: KEYS[1] requests counted exactly (sorted set:
# admission -> time), KEYS[2] requests leased, by slice (hash), KEYS[3] tokens by slice
# (hash), KEYS[4] requests in flight counted exactly (sorted set: admission -> deadline),
# KEYS[5] slots leased (hash: router -> slots), KEYS[6] the leasing routers' deadlines
# (sorted set: router -> deadline), KEYS[7] the tokens reserved by requests counted exactly
# and not yet settled (sorted set: admission -> slice), so that a settlement counts once.
# Times are Redis-clock seconds sent by the router.
# Seconds a key's counts are kept after their last change: a minute and what a slice adds.
_KEEP = f"local KEEP = {math.ceil(WINDOW + 2 * SLICE)}\n"
_COMMON = (
    _KEEP
    + f"""
local SLICE, SLICES, WINDOW = {SLICE}, {SLICES}, {WINDOW}
local function sliced(hash, first)
  local flat = redis.call('HGETALL', hash)
  local total, kept, old = 0, {{}}, {{}}
  for i = 1, #flat, 2 do
    if tonumber(flat[i]) < first then
      old[#old + 1] = flat[i]
    else
      total = total + tonumber(flat[i + 1])
      kept[#kept + 1] = flat[i]
      kept[#kept + 1] = flat[i + 1]
    end
  end
  if #old > 0 then redis.call('HDEL', hash, unpack(old)) end
  return total, kept
end
local function totals(now, first)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - WINDOW)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', '(' .. first)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now)
  for _, holder in ipairs(gone) do redis.call('HDEL', KEYS[5], holder) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now) end
  local leased, r_slices = sliced(KEYS[2], first)
  local tokens, t_slices = sliced(KEYS[3], first)
  local in_flight = redis.call('ZCARD', KEYS[4])
  for _, n in ipairs(redis.call('HVALS', KEYS[5])) do in_flight = in_flight + tonumber(n) end
  return redis.call('ZCARD', KEYS[1]) + leased, r_slices, tokens, t_slices, in_flight
end
local function add(hash, field, n)
  redis.call('HINCRBY', hash, field, n)
  redis.call('EXPIRE', hash, KEEP)
end
"""
)

# One request of a key counted exactly. ARGV: now, rpm, tpm, max_concurrent (0: none),
# tokens, the admission's name, its deadline in flight. Answers {1} when admitted, else
# {0, the exact requests' times (when over rpm), requests leased by slice, tokens by slice,
# in flight}.
ADMIT = (
    _COMMON
    + """
local now = tonumber(ARGV[1])
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local here = math.floor(now / SLICE)
local requests, r_slices, tokens, t_slices, in_flight = totals(now, here - SLICES)
if (maxc > 0 and in_flight >= maxc) or (rpm > 0 and requests >= rpm)
    or (tpm > 0 and tokens + cost > tpm) then
  local times = {}
  if rpm > 0 and requests >= rpm then
    times = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  end
  return {0, times, r_slices, t_slices, in_flight}
end
redis.call('ZADD', KEYS[1], now, ARGV[6])
redis.call('EXPIRE', KEYS[1], KEEP)
if tpm > 0 and cost > 0 then
  add(KEYS[3], here, cost)
  redis.call('ZADD', KEYS[7], here, ARGV[6])
  redis.call('EXPIRE', KEYS[7], KEEP)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[4], ARGV[7], ARGV[6])
  redis.call('EXPIRE', KEYS[4], math.ceil(tonumber(ARGV[7]) - now) + 1)
end
return {1}
"""
)

# A request counted exactly has ended. KEYS: tokens by slice, in flight, reservations.
# ARGV: the slice its tokens were reserved in, tokens going back there, the slice of now,
# tokens used beyond the reservation (counted now), the admission's name. Tokens go back
# once: a settlement sent again (its first answer timed out, yet it ran) once gave them back
# twice, taking them from other requests' reservations; nor do they go back for an admission
# that never ran.
SETTLE = (
    _KEEP
    + """
local back, more = tonumber(ARGV[2]), tonumber(ARGV[4])
local reserved = redis.call('ZREM', KEYS[3], ARGV[5]) == 1
if back > 0 and reserved and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], -back)
end
if more > 0 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], more)
  redis.call('EXPIRE', KEYS[1], KEEP)
end
redis.call('ZREM', KEYS[2], ARGV[5])
return 1
"""
)

# A share of a key's limits for one router. ARGV: now, rpm, tpm, max_concurrent (0: none),
# then for requests, tokens and slots what it wants and what it needs at least, then the
# router's name and its deadline. All of what is wanted that fits is granted, or nothing when
# a need does not fit. Answers {granted requests, tokens, slots, the limit that refused (0:
# none; 1 rpm, 2 tpm, 3 slots), the exact requests' times, requests leased by slice, tokens
# by slice, in flight}.
LEASE = (
    _COMMON
    + """
local now = tonumber(ARGV[1])
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local want = {tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[9])}
local need = {tonumber(ARGV[6]), tonumber(ARGV[8]), tonumber(ARGV[10])}
local here = math.floor(now / SLICE)
local requests, r_slices, tokens, t_slices, in_flight = totals(now, here - SLICES)
local room = {rpm - requests, tpm - tokens, maxc - in_flight}
local granted, refused = {0, 0, 0}, 0
for i = 1, 3 do
  if refused == 0 and want[i] > 0 then
    if room[i] < need[i] then refused = i else granted[i] = math.min(want[i], room[i]) end
  end
end
if refused ~= 0 then
  local times = {}
  if refused == 1 then times = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES') end
  return {0, 0, 0, refused, times, r_slices, t_slices, in_flight}
end
if granted[1] > 0 then add(KEYS[2], here, granted[1]) end
if granted[2] > 0 then add(KEYS[3], here, granted[2]) end
if granted[3] > 0 then
  redis.call('HINCRBY', KEYS[5], ARGV[11], granted[3])
  redis.call('ZADD', KEYS[6], ARGV[12], ARGV[11])
  local ttl = math.ceil(tonumber(ARGV[12]) - now) + 1
  redis.call('EXPIRE', KEYS[5], ttl)
  redis.call('EXPIRE', KEYS[6], ttl)
end
return {granted[1], granted[2], granted[3], 0, {}, r_slices, t_slices, in_flight}
"""
)

# What a router gives back of a lease, or adds. KEYS: requests leased by slice, tokens by
# slice, slots leased. ARGV: the slice, requests to give back, tokens to give back (negative:
# used beyond what was leased, counted now), slots to give back, the router.
GIVE = (
    _KEEP
    + """
local r, t, s = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if r > 0 and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], -r)
end
if t > 0 and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -t)
elseif t < 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -t)
  redis.call('EXPIRE', KEYS[2], KEEP)
end
if s > 0 then
  local left = redis.call('HINCRBY', KEYS[3], ARGV[5], -s)
  if left <= 0 then redis.call('HDEL', KEYS[3], ARGV[5]) end
end
return 1
"""
)

# A router that leases slots of a key says how many it holds, and that it is alive. KEYS:
# slots leased, the routers' deadlines. ARGV: the router, the slots it holds (-1: unknown
# while its count moves: only the deadline moves on), its new deadline, now. Answers 0 when
# the store had forgotten what it holds (Redis restarted, or the router was silent past its
# deadline): it is counted again, so that other routers see those requests.
RENEW_SLOTS = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
local slots = tonumber(ARGV[2])
if slots == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
elseif slots > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], slots)
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local ttl = math.ceil(tonumber(ARGV[3]) - tonumber(ARGV[4])) + 1
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
if held then return 1 end
return 0
"""


class LimitsStore:
    """The limits' Redis server: scripts run through the breaker, times on Redis' clock."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        prefix: str = "modelfleet:limits:",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sync_clock: bool = True,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.clock = clock  # monotonic: the breaker's and the logs'
        self.wall = wall  # the router's wall clock, which `offset` corrects
        self.sync_clock = sync_clock
        self.offset = 0.0  # add to a router's wall clock to get Redis' clock
        self._synced_at = -math.inf
        self.breaker = Breaker(clock)
        self.admit = client.register_script(ADMIT)
        self.settle = client.register_script(SETTLE)
        self.lease = client.register_script(LEASE)
        self.give = client.register_script(GIVE)
        self.renew_slots = client.register_script(RENEW_SLOTS)
        self.round_trips = 0  # a figure for tests and the benchmark

    def keys(self, name: str) -> list[str]:
        """A key's seven counts, in the order the scripts take them."""
        return [
            f"{self.prefix}{name}:{what}"
            for what in (
                "requests",
                "lease-requests",
                "tokens",
                "in-flight",
                "lease-slots",
                "lease-holders",
                "reserved",
            )
        ]

    def time(self, wall: float) -> float:
        """A router's wall-clock time on Redis' clock."""
        return wall + self.offset

    async def call(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """One round trip through the breaker; StoreUnavailable when it fails or is open."""
        import redis.exceptions

        if self.breaker.open:
            raise StoreUnavailable("the limits store is taken as unreachable", sent=False)
        try:
            if self.sync_clock and self.clock() - self._synced_at > SYNC_EVERY:
                await self._sync()
            answer = await work()
        except (redis.exceptions.RedisError, OSError) as exc:
            if self.breaker.failed():
                log.warning(
                    "the limits store failed %d times in a row (%s): taken as unreachable "
                    "until it answers again",
                    self.breaker.failures,
                    _why(exc),
                )
            raise StoreUnavailable(_why(exc)) from exc
        self.round_trips += 1
        self.breaker.succeeded()
        return answer

    async def script(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self.call(lambda: script(keys=keys, args=args))

    async def pipelined(
        self, calls: Sequence[tuple[Any, Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        """Run each (script, keys, args) in one pipeline: one round trip. Each answer is the
        script's, or the exception it raised."""

        async def work() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))

        return list(await self.call(work))

    async def _sync(self) -> None:
        """Learn the offset of Redis' clock from this host's."""
        before = self.wall()
        seconds, micros = await self.client.time()
        after = self.wall()
        self.offset = seconds + micros / 1e6 - (before + after) / 2
        self._synced_at = self.clock()

    async def probe(self) -> bool:
        """Ask an unreachable server whether it answers again; True when it does."""
        try:
            async with asyncio.timeout(TIMEOUT):
                await self.client.ping()
        except Exception:  # any failure means: not yet
            return False
        if self.breaker.succeeded():
            log.warning("the limits store answers again")
        return True


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def client_for(url: str) -> redis.asyncio.Redis:
    """A client of the limits store at `url`: short timeouts (the breaker counts them), a
    command on a dead pooled connection sent once more on a new one, and nothing else
    retried (redis-py's default retries timeouts too, ten times with backoff)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=TIMEOUT,
        socket_connect_timeout=TIMEOUT,
        decode_responses=False,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
