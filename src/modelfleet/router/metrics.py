"""The router's Prometheus metrics, served at `GET /metrics` on its client listener.

`modelfleet_router_overhead_seconds` is the time a request spent in the router itself: its whole
time here less the time spent waiting for the engine (connecting, the first byte, each chunk
after it). That splits router time from engine time, which no other figure does.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From 0.1 ms: the router's own time is counted in tenths of milliseconds.
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Every metric of one router, in a registry of its own (tests make many routers)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelfleet_router_requests",
            "Requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "modelfleet_router_request_seconds",
            "Time from the request's arrival to the end of its answer.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "modelfleet_router_first_byte_seconds",
            "Time from the request's arrival to the first byte of the engine's answer "
            "(the first token of a stream).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "modelfleet_router_overhead_seconds",
            "Time spent in the router itself per request, excluding waits for the engine.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "modelfleet_router_in_flight",
            "Requests in flight, by endpoint.",
            ["endpoint"],
            registry=r,
        )
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
        self.rejections = Counter(
            "modelfleet_router_rejections",
            "Requests the router answered itself with an error, by reason.",
            ["reason"],
            registry=r,
        )
        self.cancellations = Counter(
            "modelfleet_router_client_disconnects",
            "Requests whose client went away before the answer ended; each was cancelled upstream.",
            ["model"],
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: a request's handful of metrics cost a dict lookup
        each instead of prometheus-client's label checks (seen in the router's profile)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
