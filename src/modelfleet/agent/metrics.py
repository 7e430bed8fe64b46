"""The agent's Prometheus metrics, served at `GET /metrics` on its admin listener.

Counts of what happens between scrapes (engines failing, restarted, probes failing, how long
engines take to start) in a registry of the agent's own, and the node as it is when scraped
(shards by state, each GPU's memory and health), read by a collector.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelfleet.messages.wire import GpuReport, ShardState

_START_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# Why an engine failed: the `reason` label of failures and restarts.
FAILURE_REASONS = ("exited", "startup-timeout", "unhealthy", "cannot-start", "supervision")


class AgentMetrics:
    """Every metric of one agent, in a registry of its own (tests make many)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.failures = Counter(
            "modelfleet_agent_shard_failures",
            "Engines that failed, by why: exited, startup-timeout, unhealthy (health probes "
            "failed in a row), cannot-start, supervision.",
            ["reason"],
            registry=r,
        )
        self.restarts = Counter(
            "modelfleet_agent_shard_restarts",
            "Engines the agent started again after a failure, by why they failed (a replica "
            "of several shards is restarted by the control plane instead).",
            ["reason"],
            registry=r,
        )
        self.probe_failures = Counter(
            "modelfleet_agent_probe_failures",
            "Health probes of ready engines that failed or timed out.",
            registry=r,
        )
        self.start_seconds = Histogram(
            "modelfleet_agent_engine_start_seconds",
            "From an engine's start to its first ready probe.",
            buckets=_START_BUCKETS,
            registry=r,
        )
        for reason in FAILURE_REASONS:  # every series there from the first scrape
            self.failures.labels(reason)
            self.restarts.labels(reason)

    def watch(
        self, shard_states: Callable[[], Iterable[ShardState]], gpus: Callable[[], list[GpuReport]]
    ) -> None:
        """Read the shards' states and the GPUs at every scrape."""
        self.registry.register(_NodeCollector(shard_states, gpus))


class _NodeCollector(Collector):
    def __init__(
        self, shard_states: Callable[[], Iterable[ShardState]], gpus: Callable[[], list[GpuReport]]
    ) -> None:
        self.shard_states = shard_states
        self.gpus = gpus

    def collect(self) -> Iterator[Metric]:
        shards = GaugeMetricFamily(
            "modelfleet_agent_shards",
            "Shards this agent runs, by state: starting, ready, failed, stopping.",
            labels=["state"],
        )
        counted = Tally(self.shard_states())
        for state in ShardState:
            shards.add_metric([state.value], counted[state])
        yield shards
        used = GaugeMetricFamily(
            "modelfleet_agent_gpu_memory_used_bytes", "Memory in use, per GPU.", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "modelfleet_agent_gpu_memory_total_bytes", "Memory, per GPU.", labels=["gpu"]
        )
        healthy = GaugeMetricFamily(
            "modelfleet_agent_gpu_healthy", "1 when the GPU is healthy, per GPU.", labels=["gpu"]
        )
        busy = GaugeMetricFamily(
            "modelfleet_agent_gpu_utilization_percent",
            "The share of time a kernel ran, per GPU that says it (NVML's utilization.gpu).",
            labels=["gpu"],
        )
        for gpu in self.gpus():
            index = str(gpu.index)
            used.add_metric([index], gpu.memory_used)
            total.add_metric([index], gpu.memory_total)
            healthy.add_metric([index], int(gpu.healthy))
            if gpu.utilization is not None:
                busy.add_metric([index], gpu.utilization)
        yield from (used, total, healthy, busy)
