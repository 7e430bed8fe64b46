"""The router's Prometheus metrics, served at `GET /metrics` on its push listener (its token).

`modelfleet_router_overhead_seconds` is the time a request spent in the router itself: its whole
time here less the time spent waiting for the engine (connecting, the first byte, each chunk
after it). That splits router time from engine time, which no other figure does.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from modelfleet.host.files import write_atomic
from modelfleet.http.engine_metrics import TIME_SIGNALS
from modelfleet.router.engine_load import EngineTimes

# From 0.1 ms: the router's own time is counted in tenths of milliseconds.
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# A token every 5 ms (a small model on a fast GPU) to one a second (a stalled one).
_INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
# The families of what the router read of its engines' own histograms (`EngineTimes`): every
# router and worker reads the same engines, so several routers' are not summed (`summed`).
ENGINE_READ = "modelfleet_router_engine_"
_ENGINE_DOCS = {
    "first_token": "Time from a request's arrival at the engine to its first token, as the "
    "engines count it (vLLM's time_to_first_token_seconds, SGLang's), by model: the "
    "buckets each engine counted since the router began reading it.",
    "token_gap": "Time between two tokens of an answer, as the engines count it (vLLM's "
    "inter_token_latency_seconds, SGLang's), by model: the buckets each engine counted "
    "since the router began reading it.",
}


class Tally:
    """A histogram's counts per label set, kept as plain lists: observing is a bisect and
    three additions, where prometheus-client's Histogram took a lock per bucket. Read only
    when `/metrics` is scraped."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts: dict[tuple[str, ...], list[float]] = {}  # per bucket, then +Inf, then sum

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0.0] * (len(self.buckets) + 2)
        counts[bisect_left(self.buckets, value)] += 1
        counts[-1] += value

    def family(self, name: str, doc: str, label_names: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=label_names)
        bounds = [*(str(float(b)) for b in self.buckets), "+Inf"]
        for labels, counts in self.counts.items():
            cumulative, running = [], 0.0
            for bound, n in zip(bounds, counts[:-1], strict=True):
                running += n
                cumulative.append((bound, running))
            family.add_metric(list(labels), cumulative, counts[-1])
        return family


class RouterMetrics:
    """Every metric of one router, in a registry of its own (tests make many routers).

    What is counted for every request (requests by status; for those sent to an engine,
    latency, time to first byte and the router's own time; for those it refused, why) are
    plain counts folded into Prometheus's form when scraped, as are the requests in flight,
    read from the balancer's own counts. The rest are prometheus-client metrics: they move on
    failures only.
    """

    def __init__(
        self,
        in_flight: Callable[[], Mapping[str, int]] = dict,
        held: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.answered: dict[tuple[str, str], int] = {}  # (model, status) -> requests
        self.refusals: dict[tuple[str, str, str], int] = {}  # (model, status, reason) -> them
        self.tokens: dict[tuple[str, str], int] = {}  # (model, prompt|completion) -> tokens
        self.latency = Tally(_LATENCY_BUCKETS)
        self.ttft = Tally(_LATENCY_BUCKETS)
        self.inter_token = Tally(_INTER_TOKEN_BUCKETS)
        self.overhead = Tally(_OVERHEAD_BUCKETS)
        self.in_flight = in_flight  # endpoint -> requests in flight there now
        self.engine_times = EngineTimes()  # the engines' own histograms, read by the watch
        self.held = held  # model -> requests held since the start (`cold.py`)
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_PerRequest(self))
        self.retries = Counter(
            "modelfleet_router_retries",
            "Requests sent again to another replica before their first byte, by model.",
            ["model"],
            registry=r,
        )
        self.ejections = Counter(
            "modelfleet_router_ejections",
            "Endpoints taken out of rotation after failing again and again.",
            ["endpoint"],
            registry=r,
        )
        self.cancellations = Counter(
            "modelfleet_router_client_disconnects",
            "Requests whose client went away before the answer ended; each was cancelled upstream.",
            ["model"],
            registry=r,
        )

    def request_done(
        self,
        model: str,
        status: int,
        seconds: float,
        first_byte: float | None,
        own: float,
        inter_token: float | None = None,
    ) -> None:
        """One request sent to an engine and answered: its status, its whole time, its time to
        the engine's first byte (None: no engine answered), the router's own time in it, and
        for a stream of several tokens, the mean time between its tokens."""
        key = (model, str(status))
        self.answered[key] = self.answered.get(key, 0) + 1
        labels = (model,)
        self.latency.observe(labels, seconds)
        if first_byte is not None:
            self.ttft.observe(labels, first_byte)
        if inter_token is not None:
            self.inter_token.observe(labels, inter_token)
        self.overhead.observe((), own)

    def refused(self, model: str, status: int, reason: str) -> None:
        """One request the router answered itself, sent to no engine: counted as answered
        and as refused, and kept out of the latency histograms, whose times it would bend
        (a key over its limit made a model look four times faster)."""
        key = (model, str(status))
        self.answered[key] = self.answered.get(key, 0) + 1
        why = (model, str(status), reason)
        self.refusals[why] = self.refusals.get(why, 0) + 1

    def used(self, model: str, prompt: int, completion: int) -> None:
        """The tokens an engine said a request of `model` (a model, or an adapter) used."""
        for kind, n in (("prompt", prompt), ("completion", completion)):
            self.tokens[(model, kind)] = self.tokens.get((model, kind), 0) + n

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: a request's handful of metrics cost a dict lookup
        each instead of prometheus-client's label checks (seen in the router's profile)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


class _PerRequest(Collector):
    """The per-request counts of `RouterMetrics`, in Prometheus's form."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        requests = CounterMetricFamily(
            "modelfleet_router_requests",
            "Requests answered, by model and HTTP status.",
            labels=["model", "status"],
        )
        for labels, n in m.answered.items():
            requests.add_metric(list(labels), n)
        yield requests
        refusals = CounterMetricFamily(
            "modelfleet_router_refusals",
            "Requests the router answered itself and sent to no engine (no key, no such "
            "model, a key over its limit, no replica ready...), by model, status and reason.",
            labels=["model", "status", "reason"],
        )
        for why, n in m.refusals.items():
            refusals.add_metric(list(why), n)
        yield refusals
        tokens = CounterMetricFamily(
            "modelfleet_router_tokens",
            "Tokens the engines said requests used, by model (a LoRA adapter is a model of "
            "its own here) and kind: prompt or completion.",
            labels=["model", "kind"],
        )
        for labels, n in m.tokens.items():
            tokens.add_metric(list(labels), n)
        yield tokens
        held = CounterMetricFamily(
            "modelfleet_router_held",
            "Requests held while nothing served them: a model at zero replicas, or a LoRA "
            "adapter loaded nowhere yet.",
            labels=["model"],
        )
        for model, n in m.held().items():
            held.add_metric([model], n)
        yield held
        yield m.latency.family(
            "modelfleet_router_request_seconds",
            "Time from the request's arrival to the end of its answer, of requests sent to an "
            "engine.",
            ["model"],
        )
        yield m.ttft.family(
            "modelfleet_router_first_byte_seconds",
            "Time from the request's arrival to the first byte of the engine's answer "
            "(the first token of a stream).",
            ["model"],
        )
        yield m.inter_token.family(
            "modelfleet_router_inter_token_seconds",
            "Mean time between the tokens of a streamed answer (its time after the first "
            "byte over its completion tokens but one), one observation per stream of two "
            "tokens or more.",
            ["model"],
        )
        yield m.overhead.family(
            "modelfleet_router_overhead_seconds",
            "Time spent in the router itself per request sent to an engine, excluding waits "
            "for the engine.",
            [],
        )
        yield from _engine_families(m.engine_times)
        in_flight = GaugeMetricFamily(
            "modelfleet_router_in_flight", "Requests in flight, by endpoint.", labels=["endpoint"]
        )
        for endpoint, n in m.in_flight().items():
            in_flight.add_metric([endpoint], n)
        yield in_flight


def _engine_families(times: EngineTimes) -> Iterator[Metric]:
    for time, signal in TIME_SIGNALS.items():
        family = HistogramMetricFamily(
            f"{ENGINE_READ}{signal}", _ENGINE_DOCS[time], labels=["model"]
        )
        for (model, of), counts in sorted(times.counts.items()):
            if of == time and math.inf in counts:
                bounds = sorted(counts.items())
                shown = [("+Inf" if math.isinf(le) else str(le), n) for le, n in bounds]
                family.add_metric([model], shown, None)
        yield family


def summed(texts: Iterable[str], same_engines: bool = False) -> bytes:
    """Several scrapes as one: every sample summed over them (counts, histogram buckets,
    requests in flight), but `_created` times, of which the earliest is kept. `same_engines`:
    the scrapes are of workers that each read the same engines, whose readings (ENGINE_READ)
    are then the largest of them, not their sum (one worker's runs are summed)."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            largest = same_engines and family.name.startswith(ENGINE_READ)
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sample.labels.items()))
                if sample.name.endswith("_created"):
                    values[key] = min(values.get(key, sample.value), sample.value)
                elif largest:
                    values[key] = max(values.get(key, 0.0), sample.value)
                else:
                    values[key] = values.get(key, 0.0) + sample.value
    for (family_name, name, labels), value in values.items():
        families[family_name].add_sample(name, dict(labels), value)

    class Summed(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Summed())
    return generate_latest(registry)


COUNTS_SUFFIX = ".counts"  # a worker's counts file: its ready file's name, with this suffix

# The families whose samples only ever grow while their process runs.
_COUNTING = frozenset({"counter", "histogram", "summary"})


def counting_only(text: str) -> str:
    """The counters, histograms and summaries of a scrape, its gauges left out: what a
    process had counted, which stays true once it has stopped (its gauges do not)."""
    registry = CollectorRegistry(auto_describe=False)
    kept = [f for f in text_string_to_metric_families(text) if f.type in _COUNTING]

    class Kept(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from kept

    registry.register(Kept())
    return generate_latest(registry).decode()


class WorkerCounts:
    """What one worker of a router has shown, in a file beside its ready file, so that the
    router's counters never go back: a worker restarted after a crash carries on from what
    its runs before had shown (their counters added to its own), and one that stalls is
    summed from its file until it answers again.

    The file is written before a scrape is answered, so any count a scrape showed is in it;
    what a worker counted after the last scrape and before it died is lost, not taken back.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.carried = counting_only(path.read_text())
        except FileNotFoundError:
            self.carried = ""

    def shown(self, own: bytes) -> bytes:
        """This worker's own scrape with its earlier runs' counts added, kept in the file."""
        text = summed([own.decode(), self.carried]) if self.carried else own
        write_atomic(self.path, text.decode(), durable=False)  # a crash of the host ends all
        return text


def last_shown(path: Path) -> str | None:
    """The counts a worker last showed (`WorkerCounts`), for a scrape it does not answer."""
    try:
        return counting_only(path.read_text())
    except FileNotFoundError:
        return None
