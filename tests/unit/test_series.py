"""The routers' numbers the dashboard plots: counters read from their metrics pages, summed
over routers, one point per interval; a router that restarted counts from zero again."""

from __future__ import annotations

import asyncio
import math

import httpx

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.series import RouterSeries, Series, read_totals


def page(requests_200: int, requests_503: int, first_byte_sum: float, count: int) -> str:
    return f"""# TYPE modelfleet_router_requests counter
modelfleet_router_requests_total{{model="m",status="200"}} {requests_200}
modelfleet_router_requests_total{{model="m",status="503"}} {requests_503}
# TYPE modelfleet_router_first_byte_seconds histogram
modelfleet_router_first_byte_seconds_bucket{{model="m",le="+Inf"}} {count}
modelfleet_router_first_byte_seconds_sum{{model="m"}} {first_byte_sum}
modelfleet_router_first_byte_seconds_count{{model="m"}} {count}
# TYPE modelfleet_router_request_seconds histogram
modelfleet_router_request_seconds_bucket{{model="m",le="+Inf"}} {count}
modelfleet_router_request_seconds_sum{{model="m"}} {first_byte_sum * 2}
modelfleet_router_request_seconds_count{{model="m"}} {count}
"""


def test_a_metrics_page_reads_as_counters_per_model() -> None:
    [(model, t)] = read_totals(page(10, 2, 1.5, 12)).items()
    assert model == "m" and (t.count("requests"), t.count("errors")) == (12, 2)
    assert t.buckets == {("first_byte", math.inf): 12, ("request", math.inf): 12}


def test_refusals_are_a_line_of_their_own_and_not_engine_errors() -> None:
    """Issue 41: errors/s counted every 5xx, the router's own 503s too, and nothing else:
    31 % of requests refused for a key's limit showed as 0."""
    refused = (
        page(10, 5, 1.5, 12)
        + """# TYPE modelfleet_router_refusals counter
modelfleet_router_refusals_total{model="m",reason="no-ready-replica",status="503"} 3
modelfleet_router_refusals_total{model="m",reason="key-rpm",status="429"} 4
"""
    )
    [(_, t)] = read_totals(refused).items()
    counted = (t.count("requests"), t.count("errors"), t.count("refusals"))
    assert counted == (15, 2, 7)  # 2 of the 503s came from engines


def test_points_sum_the_routers_and_a_restarted_router_counts_from_zero() -> None:
    pages = {"a": [page(0, 0, 0, 0), page(10, 0, 1.0, 10), page(3, 1, 0.4, 4)],
             "b": [page(5, 0, 0.5, 5), page(15, 0, 1.5, 15), page(25, 0, 2.5, 25)]}  # fmt: skip
    turn = {"a": 0, "b": 0}

    def answer(request: httpx.Request) -> httpx.Response:
        router = request.url.host
        text = pages[router][turn[router]]
        turn[router] += 1
        return httpx.Response(200, text=text)

    clock = [100.0]
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    routers = [
        RouterTarget(url="http://a", token="t" * 16),
        RouterTarget(url="http://b", token="t" * 16),
    ]
    series = RouterSeries(routers, http, 10.0, lambda: clock[0])

    async def go() -> None:
        await series.sample()  # the first reading: nothing to count from
        assert series.series.of("m") == []
        clock[0] += 10
        await series.sample()
        clock[0] += 10
        await series.sample()

    asyncio.run(go())
    first, second = series.series.of("m")
    assert first.requests_per_s == 2.0  # 10 + 10 in 10 s
    # Router a restarted: its 4 since count whole; b counted 10 more.
    assert second.requests_per_s == 1.4 and second.errors_per_s == 0.1
    assert second.at == 120.0


def histogram(counts: dict[float, int]) -> str:
    """A first-byte histogram of model m with these cumulative counts by bound."""
    lines = ["# TYPE modelfleet_router_first_byte_seconds histogram"]
    for le, n in counts.items():
        bound = "+Inf" if math.isinf(le) else str(le)
        lines.append(f'modelfleet_router_first_byte_seconds_bucket{{model="m",le="{bound}"}} {n}')
    total = max(counts.values())
    lines += [f'modelfleet_router_first_byte_seconds_count{{model="m"}} {total}',
              'modelfleet_router_first_byte_seconds_sum{model="m"} 1.0']  # fmt: skip
    return "\n".join(lines) + "\n"


def test_percentiles_come_from_the_buckets_counted_in_the_interval() -> None:
    """Issue 41: only means were shown (a mean hides the slow tail the p99 shows)."""
    before = read_totals(histogram({0.1: 10, 0.5: 10, 1.0: 10, math.inf: 10}))["m"]
    after = read_totals(histogram({0.1: 60, 0.5: 90, 1.0: 109, math.inf: 110}))["m"]
    since = after.minus(before)  # 50 under 0.1 s, 30 to 0.5 s, 19 to 1 s, 1 over
    assert since.quantile("first_byte", 0.5) == 0.1  # the 50th of 100 is the last under 0.1
    assert since.quantile("first_byte", 0.95) == 0.5 + 0.5 * (95 - 80) / 19
    assert since.quantile("first_byte", 0.99) == 1.0  # in +Inf: the last finite bound
    assert since.quantile("request", 0.5) is None  # no request time read: nothing to say
    series = Series(10.0)
    series.add(100.0, 10.0, {"m": since})
    [point] = series.of("m")
    assert point.times["first_byte_p50"] == 0.1 and point.times["request_p99"] is None
