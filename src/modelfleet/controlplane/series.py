"""What the dashboard plots: numbers over time per model, node and key, kept in the store so
that plots outlive a control-plane restart, and cover a week.

Three sources feed one `Recorder`, each adding what it counted as `Totals` (sums, and
histograms' buckets):
- **models**: every step the control plane reads each router's metrics (through its push API,
  which answers the sum over the router's workers) and adds what each model counted since the
  last read: requests, server errors, refusals, completion tokens, and the buckets of the
  time to first byte at the router, the mean time between tokens of its streams and the
  request time; and of the engines' own time to first token and between tokens, which every
  router reads from the same engines: of those, the largest count of any router is taken,
  not their sum. An error is a request sent to an engine that got a 5xx; a refusal, one the
  router answered itself (no key, a key over its limit, no replica ready...). A router that
  restarted (its counters went down) counts from zero again; one that does not answer is
  left out of that step.
- **nodes**: each agent's report and heartbeat carry its GPUs' memory in use and
  utilisation; a node's step sums what was heard in it, with how many samples, so that its
  plot shows their mean.
- **keys**: each usage batch taken from a router adds what each key did: requests, tokens,
  errors, and requests refused for its limits (429).

Every `step` seconds the leading control plane writes one point per subject that counted
something, and adds it into the subject's point of COARSE_STEP (15 minutes). Each point says
the seconds it covers (COVERED: a step's, summed into the quarter's), and a model or key
written once in a term gets a point at every step after, zero when it counted nothing, so
that a plot's rates are over the time the points cover: a quarter hour still filling, or one
in which the control plane was down a while, shows the rate of the time it has, not that
rate shrunk by the part it lacks (the first step of a term counts nothing: the routers'
first readings are where counting starts from). Points of the
step are kept FINE_KEEP_S (6 hours), coarse ones COARSE_KEEP_S (8 days): a subject costs at
most 6 h / step + 768 rows (1,128 at the default step of a minute). A plot of the last hour
or 6 hours reads points of the step, of 24 hours or 7 days the coarse ones, and merges them
into at most MAX_SHOWN points: sums add, so a merged point's rates and percentiles are those
of the time it covers, worked out from the buckets as Prometheus's `histogram_quantile` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.controlplane.config import RouterTarget
from modelfleet.messages.wire import NodeUse
from modelfleet.store import StoredPoint, StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")

COARSE_STEP = 900
FINE_KEEP_S = 6 * 3600.0
COARSE_KEEP_S = 8 * 86400.0
MAX_SHOWN = 180  # points a plot shows at most
# The spans a plot may show, by name, in seconds.
RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 24 * 3600, "7d": 7 * 86400}
QUANTILES = (0.5, 0.95, 0.99)
# The routers' histograms a point reads percentiles of, by the name a point gives them.
TIMES = {
    "first_token": "modelfleet_router_engine_time_to_first_token_seconds",
    "token_gap": "modelfleet_router_engine_inter_token_latency_seconds",
    "first_byte": "modelfleet_router_first_byte_seconds",
    "inter_token": "modelfleet_router_inter_token_seconds",
    "request": "modelfleet_router_request_seconds",
}
# Of TIMES, the engines' own, which every router reads from the same engines.
ENGINE_TIMES = frozenset({"first_token", "token_gap"})
KINDS = ("model", "node", "key")
RATED = ("model", "key")  # the kinds plotted as rates: a point at every step once seen
COVERED = "seconds"  # the count of a point that says the seconds it covers


@dataclass
class Totals:
    """What was counted: sums by name ("requests", "tokens", "memory_used", "samples"...),
    and each histogram's cumulative buckets as (time name, bound) -> count."""

    counts: dict[str, float] = field(default_factory=dict)
    buckets: dict[tuple[str, float], float] = field(default_factory=dict)

    def count(self, name: str) -> float:
        return self.counts.get(name, 0.0)

    def add(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def minus(self, earlier: Totals) -> Totals:
        """What was counted since `earlier`; all of it when a counter went down (a restart)."""
        went_down = any(v < earlier.counts.get(k, 0.0) for k, v in self.counts.items()) or any(
            v < earlier.buckets.get(k, 0.0) for k, v in self.buckets.items()
        )
        if went_down:
            return self
        return Totals(
            {k: v - earlier.counts.get(k, 0.0) for k, v in self.counts.items()},
            {k: v - earlier.buckets.get(k, 0.0) for k, v in self.buckets.items()},
        )

    def read_again(self, other: Totals) -> Totals:
        """These and `other`, another router's, counted since the same reading: sums add,
        but of the engines' histograms (ENGINE_TIMES, which both routers read from the same
        engines) the larger count of each bucket is kept."""
        summed = self.plus(other)
        for (time, le), n in other.buckets.items():
            if time in ENGINE_TIMES:
                summed.buckets[(time, le)] = max(self.buckets.get((time, le), 0.0), n)
        return summed

    def plus(self, other: Totals) -> Totals:
        counts, buckets = dict(self.counts), dict(self.buckets)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        for b, v in other.buckets.items():
            buckets[b] = buckets.get(b, 0.0) + v
        return Totals(counts, buckets)

    def quantile(self, time: str, q: float) -> float | None:
        """The `q` quantile of histogram `time`, by linear interpolation inside the bucket it
        falls in (the last finite bound when in +Inf); None with no observation."""
        bounds = sorted((le, n) for (name, le), n in self.buckets.items() if name == time)
        if not bounds or bounds[-1][1] <= 0:
            return None
        rank = q * bounds[-1][1]
        below_le, below_n = 0.0, 0.0
        for le, n in bounds:
            if n >= rank:
                if math.isinf(le):
                    return below_le
                if n == below_n:
                    return le
                return below_le + (le - below_le) * (rank - below_n) / (n - below_n)
            below_le, below_n = le, n
        return below_le

    def dumps(self) -> str:
        buckets = [
            [name, "+Inf" if math.isinf(le) else le, n] for (name, le), n in self.buckets.items()
        ]
        return json.dumps({"c": self.counts, "b": buckets}, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> Totals:
        data = json.loads(text)
        return cls(
            {str(k): float(v) for k, v in data.get("c", {}).items()},
            {(str(name), float(le)): float(n) for name, le, n in data.get("b", [])},
        )


def read_totals(text: str) -> dict[str, Totals]:
    """A router's metrics page, as counters per model."""
    out: dict[str, Totals] = {}
    histograms = {f"{family}_bucket": time for time, family in TIMES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            t = out.setdefault(model, Totals())
            name, status = sample.name, sample.labels.get("status", "")
            if name == "modelfleet_router_requests_total":
                t.add("requests", sample.value)
                if status.startswith("5"):
                    t.add("errors", sample.value)
            elif name == "modelfleet_router_refusals_total":
                t.add("refusals", sample.value)
                if status.startswith("5"):
                    t.add("errors", -sample.value)  # the router's own 503, not an engine's
            elif name == "modelfleet_router_tokens_total":
                if sample.labels.get("kind") == "completion":
                    t.add("tokens", sample.value)
            elif name in histograms:
                bound = float(sample.labels["le"])
                key = (histograms[name], bound)
                t.buckets[key] = t.buckets.get(key, 0.0) + sample.value
    return out


# -- what a plot shows ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """One point of a plot: when it ends, its numbers by name (None: nothing to say), and
    the seconds its stored points cover (its rates are over those)."""

    at: float
    values: Mapping[str, float | None]
    seconds: float = 0.0


def shown_model(t: Totals, seconds: float) -> dict[str, float | None]:
    """A model's numbers: rates per second, and percentiles in seconds."""
    out: dict[str, float | None] = {
        "requests_per_s": t.count("requests") / seconds,
        "errors_per_s": t.count("errors") / seconds,
        "refusals_per_s": t.count("refusals") / seconds,
        "tokens_per_s": t.count("tokens") / seconds,
    }
    for time in TIMES:
        for q in QUANTILES:
            out[f"{time}_p{round(q * 100)}"] = t.quantile(time, q)
    return out


def shown_node(t: Totals, seconds: float) -> dict[str, float | None]:
    """A node's GPUs: the mean of the samples heard, memory in GiB and utilisation in %."""
    n = t.count("samples")
    if n <= 0:
        return {"memory_used_gib": None, "memory_total_gib": None, "utilization_pct": None}
    util_n = t.count("utilization_samples")
    return {
        "memory_used_gib": t.count("memory_used") / n / 2**30,
        "memory_total_gib": t.count("memory_total") / n / 2**30,
        "utilization_pct": t.count("utilization") / util_n if util_n > 0 else None,
    }


def shown_key(t: Totals, seconds: float) -> dict[str, float | None]:
    """A key's rates per second."""
    return {
        "requests_per_s": t.count("requests") / seconds,
        "tokens_per_s": (t.count("prompt_tokens") + t.count("completion_tokens")) / seconds,
        "limited_per_s": t.count("limited") / seconds,
        "errors_per_s": t.count("errors") / seconds,
    }


SHOWN: dict[str, Callable[[Totals, float], dict[str, float | None]]] = {
    "model": shown_model,
    "node": shown_node,
    "key": shown_key,
}


def source_step(span: int, step: int) -> int:
    """Which points a plot of the last `span` seconds reads: the step's while they are kept."""
    return step if span <= FINE_KEEP_S else COARSE_STEP


def shown_width(span: int, step: int) -> int:
    """The seconds each point of a plot of `span` seconds covers, of stored points `step`
    seconds apart: whole stored points, at most MAX_SHOWN shown."""
    return max(1, math.ceil(span / step / MAX_SHOWN)) * step


def covered(t: Totals, step: int) -> float:
    """The seconds a stored point of `step` seconds covers: as it says (a quarter hour still
    filling, or with steps missing, covers less than its width), the whole step when it does
    not say (a point written before points said it)."""
    return t.count(COVERED) or float(step)


def shown(kind: str, points: Sequence[StoredPoint], span: int, now: float) -> list[Shown]:
    """The points of one subject over the last `span` seconds, merged into at most
    MAX_SHOWN: each shown point sums whole stored points, and its rates are over the time
    those cover so far (not over its whole width: a point still filling, or spanning a
    restart, is not shown lower than the truth). A time with no stored point shows as
    nothing (a gap), not as zero."""
    if not points:
        return []
    step = points[0].step
    width = shown_width(span, step)
    groups: dict[int, tuple[Totals, float]] = {}
    for p in points:
        if p.at + step <= now - span:
            continue
        start = p.at // width * width
        t = Totals.loads(p.body)
        held, seconds = groups.get(start, (Totals(), 0.0))
        groups[start] = (held.plus(t), seconds + covered(t, step))
    judge = SHOWN[kind]
    return [
        Shown(start + width, judge(t, seconds), seconds)
        for start, (t, seconds) in sorted(groups.items())
    ]


# -- recording -----------------------------------------------------------------------------


class Recorder:
    """Sums what the sources add over each step, and writes it to the store as points.

    Only a leading control plane writes (`acting`); one that does not lead drops what it
    counted. The coarse point of the current quarter hour is kept here as it grows, read back
    from the store at the first write after this one began to lead (another may have written
    part of it), and written anew at every step.
    """

    def __init__(self, step: int, calls: StoreCalls, wall: Callable[[], float]) -> None:
        if COARSE_STEP % step:
            raise ValueError(f"a step of {step}s does not divide {COARSE_STEP}s")
        self.step = step
        self.calls = calls
        self.wall = wall
        self.acting: Callable[[], bool] = lambda: True
        # Read just before each write, to add what they counted in the step (the routers).
        self.sources: list[Callable[[], Awaitable[None]]] = []
        self.written = 0  # writes made: a viewer's cue that there is something new to read
        self._open: dict[tuple[str, str], Totals] = {}
        self._coarse: dict[tuple[str, str], Totals] = {}
        self._coarse_at: int | None = None  # the quarter hour `_coarse` holds; None: unread
        # The models and keys written in this term: each gets a point at every step.
        self._seen: set[tuple[str, str]] = set()
        self._failure = ""

    def add(self, kind: str, subject: str, counted: Totals) -> None:
        key = (kind, subject)
        held = self._open.get(key)
        self._open[key] = counted if held is None else held.plus(counted)

    def gpus(self, node: str, use: NodeUse) -> None:
        """One sample of a node's GPUs."""
        t = Totals(
            {
                "samples": 1.0,
                "memory_used": float(use.memory_used),
                "memory_total": float(use.memory_total),
            }
        )
        if use.utilization is not None:
            t.counts["utilization"] = use.utilization
            t.counts["utilization_samples"] = 1.0
        self.add("node", node, t)

    async def run(self) -> None:
        """Write each step as it ends, until cancelled."""
        while True:
            now = self.wall()
            await asyncio.sleep(self.step - now % self.step)
            await self.write()

    async def write(self) -> None:
        """Add what the sources counted, and write the step that just ended."""
        for source in self.sources:
            await source()
        taken, self._open = self._open, {}
        if not self.acting():
            self._coarse_at = None  # another writes meanwhile: read again when leading
            self._seen = set()
            return
        for key in self._seen - taken.keys():
            taken[key] = Totals()  # counted nothing in this step: its rate is zero, not unknown
        self._seen |= {key for key in taken if key[0] in RATED}
        now = self.wall()
        try:
            # In a worker thread, building the points too: at 10,000 nodes that is 20,000
            # points. Waited for however long it takes: a slow write of plots is no outage.
            await self.calls.background(self._store, taken, now)
        except StoreError as exc:
            self._coarse_at = None  # what was added may or may not have landed: read again
            if str(exc) != self._failure:
                self._failure = str(exc)
                log.warning("the plots' points of %d s are lost: %s", self.step, exc)
            return
        self._failure = ""
        self.written += 1

    def _store(self, taken: dict[tuple[str, str], Totals], now: float) -> None:
        store = self.calls.store
        at = int(now // self.step) * self.step - self.step
        quarter = at // COARSE_STEP * COARSE_STEP
        if self._coarse_at != quarter:
            self._coarse = {
                (p.kind, p.subject): Totals.loads(p.body)
                for p in store.points(None, None, COARSE_STEP, quarter)
                if p.at == quarter
            }
            self._coarse_at = quarter
        points = []
        for (kind, subject), was in taken.items():
            counted = was.plus(Totals({COVERED: float(self.step)}))
            merged = self._coarse.get((kind, subject), Totals()).plus(counted)
            self._coarse[(kind, subject)] = merged
            points.append(StoredPoint(kind, subject, self.step, at, counted.dumps()))
            points.append(StoredPoint(kind, subject, COARSE_STEP, quarter, merged.dumps()))
        store.put_points(points, {self.step: now - FINE_KEEP_S, COARSE_STEP: now - COARSE_KEEP_S})


class RouterSeries:
    """Reads the routers' metrics at every step, and adds what each model counted since."""

    def __init__(
        self, routers: Sequence[RouterTarget], http: httpx.AsyncClient, recorder: Recorder
    ) -> None:
        self.routers = list(routers)
        self.http = http
        self.recorder = recorder
        self._last: dict[str, dict[str, Totals]] = {}  # router url -> model -> as last read
        recorder.sources.append(self.sample)

    async def sample(self) -> None:
        """Read every router once, and add what each model counted since the last read."""
        read = await asyncio.gather(*(self._read(r) for r in self.routers))
        counted: dict[str, Totals] = {}
        for router, totals in zip(self.routers, read, strict=True):
            if totals is None:
                continue
            before = self._last.get(router.url)
            self._last[router.url] = totals
            if before is None:
                continue  # its first reading: nothing to count from yet
            for model, t in totals.items():
                since = t.minus(before.get(model, Totals()))
                held = counted.get(model)
                counted[model] = since if held is None else held.read_again(since)
        for model, t in counted.items():
            self.recorder.add("model", model, t)

    async def _read(self, router: RouterTarget) -> dict[str, Totals] | None:
        try:
            answer = await self.http.get(
                f"{router.url}/v1/metrics", headers={"authorization": f"Bearer {router.token}"}
            )
            answer.raise_for_status()
            return read_totals(answer.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("no metrics from router %s: %s", router.url, exc)
            return None
