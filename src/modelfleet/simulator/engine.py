"""The engine simulator's model of an inference engine: tokens, latency, a concurrency limit.

Kept apart from HTTP so the latency model reads on its own. `SimEngine.generate` yields one
token at a time with vLLM-like timing: a time to first token that grows with the part of the
prompt not in its prefix cache, then a steady inter-token latency, and at most
`max_concurrency` requests decoding at once while the rest wait in a queue.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "the fleet serves every model behind one router while agents keep engines alive and"
    " replicas move make before break across nodes with gpus that report their health"
).split(" ")


FAULTS = ("none", "exit-at-start", "never-ready")

# vLLM's bounds (vllm/v1/metrics/buckets.py) of its histograms of the time to first token and
# between tokens, in seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True)
class SimSettings:
    """How the simulated engine behaves; every figure is a command-line flag of engine-sim."""

    model: str
    ttft: float = 0.05  # seconds to the first token for an empty prompt
    prefill_per_token: float = 0.0001  # extra seconds to first token per prompt token
    itl: float = 0.01  # seconds between output tokens
    max_concurrency: int = 16
    # The KV cache, in tokens: each running request holds its prompt and what it generated
    # so far, shown as vLLM's `vllm:kv_cache_usage_perc` (a share, 0 to 1).
    kv_cache_tokens: int = 32768
    output_tokens: int = 16  # when the request sets no max_tokens
    fault: str = "none"  # one of FAULTS: what goes wrong on purpose, for rehearsals and tests
    # Seconds after the start at which it stops answering anything, /health included, while
    # its process keeps running: a hung engine. None: never.
    hang_after: float | None = None
    api_key: str | None = None  # when set, /v1 requests must carry it (Authorization: Bearer)
    # A prefix cache as vLLM keeps one: prompts are cut into blocks of `prefix_block` tokens,
    # the last `prefix_cache_blocks` blocks seen are kept (least recently used out), and the
    # leading blocks of a prompt found there cost no prefill. 0 blocks: no cache.
    prefix_block: int = 16
    prefix_cache_blocks: int = 4096
    # Prompt and output tokens a request may hold together, as vLLM's --max-model-len: a
    # request past it is refused (400), and one naming no max_tokens gets what is left.
    max_model_len: int = 8192
    # Where its spans go by OTLP over HTTP (a collector's traces URL): one per request, the
    # child of the `traceparent` it came with. None: none are recorded.
    otlp_endpoint: str | None = None
    # vLLM's sleep mode (--enable-sleep-mode): POST /sleep?level=1|2 frees the GPU memory and
    # keeps the process, POST /wake_up brings it back; these are the seconds each takes (a
    # level-2 sleep dropped the weights too: waking reloads them, twice the wake delay).
    sleep_mode: bool = False
    sleep_delay: float = 0.2
    wake_delay: float = 1.0
    # vLLM's LoRA adapters loaded at run time (--enable-lora with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # (also at SGLang's paths, without /v1),
    # each load taking `lora_load_delay` seconds; at most `max_loras` held, the least recently
    # used let go for a new one. A request names an adapter as its model.
    enable_lora: bool = False
    max_loras: int = 4
    lora_load_delay: float = 0.5


def count_prompt_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


class PrefixCache:
    """The blocks of prompts seen lately, each known by the hash of all tokens up to its end
    (so a block matches only after the same beginning), least recently used out first."""

    def __init__(self, block: int, capacity: int) -> None:
        self.block = block
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found cached

    def take(self, tokens: list[str]) -> int:
        """How many leading tokens of `tokens` were cached; every full block of them is
        cached from now on."""
        if self.capacity <= 0:
            return 0
        cached = 0
        matching = True
        digest = hashlib.blake2b(digest_size=16)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            digest.update(
                "\x1f".join(tokens[start : start + self.block]).encode("utf-8", "surrogatepass")
            )
            key = digest.copy().digest()
            if matching and key in self._blocks:
                cached += self.block
                self._blocks.move_to_end(key)
                continue
            matching = False
            self._blocks[key] = None
            if len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        self.queries += len(tokens)
        self.hits += cached
        return cached


class LoraRefused(Exception):
    """A load or unload the engine refuses: the status and vLLM's words for it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Adapters:
    """The LoRA adapters an engine holds, least recently used first."""

    def __init__(self, capacity: int, load_delay: float) -> None:
        self.capacity = capacity
        self.load_delay = load_delay
        self.held: OrderedDict[str, str] = OrderedDict()  # name -> source
        self.loading: set[str] = set()
        self.loads = 0  # adapters loaded since the start
        self.evicted = 0  # let go to make room for another

    async def load(self, name: str, source: str) -> None:
        """Load `name` from `source` (a path that must exist, or a name the engine would
        resolve), after the load delay; the least recently used goes when it is full."""
        if name in self.held or name in self.loading:
            raise LoraRefused(400, f"The lora adapter '{name}' has already been loaded.")
        if source.startswith("/") and not Path(source).exists():
            raise LoraRefused(400, f"Loading lora {name} failed: No adapter found for {source}")
        self.loading.add(name)
        try:
            await asyncio.sleep(self.load_delay)
        finally:
            self.loading.discard(name)
        while len(self.held) >= self.capacity:
            self.held.popitem(last=False)
            self.evicted += 1
        self.held[name] = source
        self.loads += 1

    def unload(self, name: str) -> None:
        if self.held.pop(name, None) is None:
            raise LoraRefused(404, f"The lora adapter '{name}' cannot be found.")

    def use(self, name: str) -> bool:
        """Whether `name` is held; a request for it makes it the most recently used."""
        if name not in self.held:
            return False
        self.held.move_to_end(name)
        return True


class Times:
    """A histogram of seconds as vLLM keeps one: a count per bound (the last, past every
    bound), and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """(bound, observations at or under it), as Prometheus's buckets, "+Inf" last."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


@dataclass
class SleepState:
    """Whether the engine sleeps, at which level, and whether it is on its way in or out."""

    asleep: bool = False
    level: int = 0
    changing: str = ""  # "falling asleep", "waking up", or "" when neither

    @property
    def serving(self) -> bool:
        return not (self.asleep or self.changing)


class SimEngine:
    """The simulated engine's state: what is running, what waits, what was produced."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0  # held in the KV cache by the requests running now
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.cancelled_total = 0  # requests given up by their client before their end
        # As vLLM's: from a request's arrival (its wait for a slot included) to its first
        # token, and between consecutive tokens of one request.
        self.first_token = Times(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token = Times(INTER_TOKEN_LATENCY_BUCKETS)
        self.prefix_cache = PrefixCache(settings.prefix_block, settings.prefix_cache_blocks)
        self.sleep = SleepState()
        self.adapters = Adapters(settings.max_loras, settings.lora_load_delay)
        # Seconds with a request running, as a GPU counts its utilisation (the share of time
        # a kernel ran): the agent of simulated GPUs reads it as theirs.
        self._busy = 0.0
        self._busy_since: float | None = None

    def busy_seconds(self) -> float:
        """Seconds so far during which at least one request was running."""
        now = time.monotonic()
        return self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)

    def _running(self, change: int) -> None:
        if self.running == 0 and change > 0:
            self._busy_since = time.monotonic()
        self.running += change
        if self.running == 0 and self._busy_since is not None:
            self._busy += time.monotonic() - self._busy_since
            self._busy_since = None

    async def fall_asleep(self, level: int) -> None:
        """vLLM's sleep: new requests are refused from now on; once those running and waiting
        have ended, the memory is freed (`sleep_delay`)."""
        state = self.sleep
        if state.asleep or state.changing:
            return
        state.changing, state.level = "falling asleep", level
        try:
            while self.running or self.waiting:
                await asyncio.sleep(0.01)
            await asyncio.sleep(self.settings.sleep_delay)
            state.asleep = True
        finally:
            state.changing = ""

    async def wake_up(self) -> None:
        """Back to serving, after the wake delay (twice it from level 2: the weights reload)."""
        state = self.sleep
        if not state.asleep or state.changing:
            return
        state.changing = "waking up"
        try:
            await asyncio.sleep(self.settings.wake_delay * (2 if state.level == 2 else 1))
            state.asleep = False
        finally:
            state.changing = ""

    async def generate(self, prompt: str, max_tokens: int | None) -> AsyncIterator[str]:
        """Yield the output tokens for `prompt`, each after its simulated delay."""
        words = prompt.split()
        n_prompt = max(1, len(words))
        n_out = self.settings.output_tokens if max_tokens is None else max(0, max_tokens)
        seed = int.from_bytes(
            hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=4).digest(), "big"
        )
        finished = False
        arrived = time.monotonic()
        try:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            self._running(+1)
            self.prompt_tokens_total += n_prompt
            self.requests_total += 1
            held = n_prompt
            self.kv_tokens += held
            to_prefill = n_prompt - self.prefix_cache.take(words)
            try:
                await asyncio.sleep(
                    self.settings.ttft + to_prefill * self.settings.prefill_per_token
                )
                last = arrived
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(self.settings.itl)
                    now = time.monotonic()
                    (self.inter_token if i else self.first_token).observe(now - last)
                    last = now
                    self.generation_tokens_total += 1
                    held += 1
                    self.kv_tokens += 1
                    yield " " + _WORDS[(seed + i) % len(_WORDS)]
                finished = True
            finally:
                self._running(-1)
                self.kv_tokens -= held
                self._slots.release()
        finally:
            if not finished:
                self.cancelled_total += 1
