"""Engines' own metrics under one set of names, so that one dashboard serves every engine.

vLLM, SGLang, llama.cpp and the simulator each name what they count their own way. This is
the one mapping from theirs to `modelfleet_engine_*` (MAPPING_VERSION says which; a change
of it is a new version): the agent republishes what its engines say under these names, with
`model`, `replica` and `node` labels (`translate`), and the router reads an engine's load
from the same names (`router/engine_load.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

MAPPING_VERSION = 1


@dataclass(frozen=True)
class Signal:
    """One thing every engine says: our name, its type, and each engine's names for it (the
    first an engine's page shows is taken)."""

    name: str
    kind: str  # "gauge" or "histogram"
    doc: str
    sources: tuple[str, ...]


SIGNALS = (
    Signal("requests_running", "gauge", "Requests the engine is running now.",
           ("vllm:num_requests_running", "sglang:num_running_reqs",
            "llamacpp:requests_processing")),
    Signal("requests_waiting", "gauge", "Requests waiting at the engine for a slot.",
           ("vllm:num_requests_waiting", "sglang:num_queue_reqs",
            "llamacpp:requests_deferred")),
    Signal("kv_cache_usage_ratio", "gauge", "The share of the KV cache in use (0 to 1).",
           ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "llamacpp:kv_cache_usage_ratio")),
    Signal("prefix_cache_hit_ratio", "gauge",
           "The share of prompt tokens found in the prefix cache, since the engine started.",
           ("sglang:cache_hit_rate",)),
    Signal("time_to_first_token_seconds", "histogram", "Time to first token, at the engine.",
           ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")),
    Signal("inter_token_latency_seconds", "histogram",
           "Time between tokens of an answer, at the engine.",
           ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "sglang:inter_token_latency_seconds")),
)  # fmt: skip
# vLLM counts prefix-cache hits and queries; their ratio is `prefix_cache_hit_ratio`.
_HITS, _QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
LOAD_SIGNALS = ("requests_running", "requests_waiting")


def load_sources() -> frozenset[str]:
    """Every engine's names for requests running and waiting: an engine's load."""
    return frozenset(n for s in SIGNALS if s.name in LOAD_SIGNALS for n in s.sources)


def cache_sources() -> frozenset[str]:
    """Every engine's names for the share of its KV cache in use."""
    return frozenset(_signal("kv_cache_usage_ratio").sources)


# The engines' own histograms the router reads for the dashboard's plots, by the name the
# plots give them: the time to first token and between tokens.
TIME_SIGNALS = {
    "first_token": "time_to_first_token_seconds",
    "token_gap": "inter_token_latency_seconds",
}


def time_sources() -> dict[str, tuple[str, ...]]:
    """Each of TIME_SIGNALS by every engine's names for it, in the order they are taken (the
    first an engine's page shows)."""
    return {time: _signal(name).sources for time, name in TIME_SIGNALS.items()}


def translate(pages: Iterable[tuple[dict[str, str], str]]) -> bytes:
    """Engines' `/metrics` pages, each with the labels to give its series (model, replica,
    node), as `modelfleet_engine_*` families in Prometheus text."""
    families = {s.name: Metric(f"modelfleet_engine_{s.name}", s.doc, s.kind) for s in SIGNALS}
    version = Metric("modelfleet_engine_metrics_mapping", "The mapping's version.", "gauge")
    version.add_sample("modelfleet_engine_metrics_mapping", {}, MAPPING_VERSION)
    for labels, page in pages:
        _add(families, labels, page)

    class Translated(Collector):
        def collect(self) -> Iterator[Metric]:
            yield version
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Translated())
    return generate_latest(registry)


def _add(families: dict[str, Metric], labels: dict[str, str], page: str) -> None:
    found = {f.name: f for f in text_string_to_metric_families(page)}
    for signal in SIGNALS:
        source = next((found[n] for n in signal.sources if n in found), None)
        if source is None:
            continue
        target = families[signal.name]
        if signal.kind == "gauge":
            value = sum(s.value for s in source.samples)
            target.add_sample(target.name, labels, value)
            continue
        # A histogram: its buckets, sum and count, summed over the engine's own label sets.
        summed: dict[tuple[str, str], float] = {}
        for sample in source.samples:
            suffix = sample.name[len(source.name) :]
            if suffix not in ("_bucket", "_sum", "_count"):
                continue
            key = (suffix, sample.labels.get("le", ""))
            summed[key] = summed.get(key, 0.0) + sample.value
        for (suffix, le), value in summed.items():
            extra = {"le": le} if suffix == "_bucket" else {}
            target.add_sample(target.name + suffix, {**labels, **extra}, value)
    if not any(n in found for n in _signal("prefix_cache_hit_ratio").sources):
        totals: dict[str, float] = {}
        for family in found.values():
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        asked = totals.get(f"{_QUERIES}_total", 0.0)
        if asked > 0:
            ratio = families["prefix_cache_hit_ratio"]
            ratio.add_sample(ratio.name, labels, totals.get(f"{_HITS}_total", 0.0) / asked)


def _signal(name: str) -> Signal:
    return next(s for s in SIGNALS if s.name == name)
