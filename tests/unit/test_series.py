"""The numbers the dashboard plots: the routers' counters read from their metrics pages,
summed over routers, one point per step; a router that restarted counts from zero again;
points kept in the store, a quarter hour's growing across a restart; nodes' GPU samples as
means; a range's points merged without losing a request."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Mapping, Sequence

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.series import (
    COARSE_STEP,
    COVERED,
    FINE_KEEP_S,
    MAX_SHOWN,
    RANGES,
    Recorder,
    RouterSeries,
    Totals,
    read_totals,
    shown,
    shown_model,
    shown_node,
)
from modelfleet.messages.wire import GpuReport, NodeUse
from modelfleet.store import StoredPoint, StoreError
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore


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


def recorder(store: SqliteStore, clock: list[float], step: int = 10) -> Recorder:
    return Recorder(step, StoreCalls(store, 5.0, lambda: clock[0]), lambda: clock[0])


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
    store = SqliteStore(":memory:")
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    routers = [
        RouterTarget(url="http://a", token="t" * 16),
        RouterTarget(url="http://b", token="t" * 16),
    ]
    rec = recorder(store, clock)
    RouterSeries(routers, http, rec)

    async def go() -> None:
        await rec.write()  # the first reading: nothing to count from
        assert store.points("model", "m", 10, 0) == []
        clock[0] += 10
        await rec.write()
        clock[0] += 10
        await rec.write()

    asyncio.run(go())
    points = store.points("model", "m", 10, 0)
    assert [p.at for p in points] == [100, 110]  # each the step that just ended
    first, second = (shown_model(Totals.loads(p.body), 10) for p in points)
    assert first["requests_per_s"] == 2.0  # 10 + 10 in 10 s
    # Router a restarted: its 4 since count whole; b counted 10 more.
    assert second["requests_per_s"] == 1.4 and second["errors_per_s"] == 0.1


def test_a_model_s_time_to_first_token_is_the_engines_read_once_over_every_router() -> None:
    """Issue 57: "time to first byte" was plotted as if it were time to first token (151 vs
    75 ms). The engines' own histograms, which each router reads from the same engines, are
    plotted as time to first token: counted once, however many routers read them."""

    def engines(fast: int, slow: int, first_byte_s: float) -> str:
        name = "modelfleet_router_engine_time_to_first_token_seconds"
        return (
            f"# TYPE {name} histogram\n"
            f'{name}_bucket{{model="m",le="0.08"}} {fast}\n'
            f'{name}_bucket{{model="m",le="+Inf"}} {fast + slow}\n'
            + histogram({first_byte_s: fast + slow, math.inf: fast + slow})
        )

    # Both routers read 10 fast and 10 slow first tokens; their own first bytes came later.
    pages = {"a": [engines(0, 0, 0.2), engines(10, 10, 0.2)],
             "b": [engines(0, 0, 0.2), engines(9, 10, 0.2)]}  # fmt: skip
    turn = {"a": 0, "b": 0}

    def answer(request: httpx.Request) -> httpx.Response:
        router = request.url.host
        turn[router] += 1
        return httpx.Response(200, text=pages[router][turn[router] - 1])

    clock = [100.0]
    store = SqliteStore(":memory:")
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    routers = [RouterTarget(url=f"http://{r}", token="t" * 16) for r in "ab"]
    rec = recorder(store, clock)
    RouterSeries(routers, http, rec)

    async def go() -> None:
        await rec.write()
        clock[0] += 10
        await rec.write()

    asyncio.run(go())
    [point] = store.points("model", "m", 10, 0)
    t = Totals.loads(point.body)
    assert t.buckets[("first_token", math.inf)] == 20  # the larger reading, not 20 + 19
    assert t.buckets[("first_byte", math.inf)] == 39  # each router's own requests: summed
    values = shown_model(t, 10)
    assert values["first_token_p50"] == 0.08  # the engines', read by the routers
    assert values["first_byte_p50"] == pytest.approx(0.1)  # the routers' own, in 0.2 s


def test_the_quarter_hour_point_grows_with_each_step_and_across_a_restart() -> None:
    """Plots survive a restart (issue 41): a control plane that starts leading mid-quarter
    adds to the quarter's point another wrote, and one that does not lead writes nothing."""
    clock = [1800.0 + 5]
    store = SqliteStore(":memory:")

    async def step(rec: Recorder, requests: float) -> None:
        rec.add("model", "m", Totals({"requests": requests}))
        clock[0] += 10
        await rec.write()

    async def go() -> None:
        first = recorder(store, clock)
        await step(first, 3)
        await step(first, 4)
        second = recorder(store, clock)  # the restarted control plane
        await step(second, 5)
        second.acting = lambda: False
        await step(second, 100)  # not leading: dropped
        second.acting = lambda: True
        await step(second, 1)

    asyncio.run(go())
    [quarter] = store.points("model", "m", COARSE_STEP, 0)
    assert quarter.at == 1800 and Totals.loads(quarter.body).count("requests") == 13
    fine = store.points("model", "m", 10, 0)
    assert [Totals.loads(p.body).count("requests") for p in fine] == [3, 4, 5, 1]


def test_old_points_are_forgotten_by_their_step() -> None:
    clock = [0.0]
    store = SqliteStore(":memory:")
    rec = recorder(store, clock, step=60)

    async def go() -> None:
        for _ in range(3):
            rec.add("key", "k", Totals({"requests": 1}))
            clock[0] += FINE_KEEP_S / 2
            await rec.write()

    asyncio.run(go())
    assert len(store.points("key", "k", 60, 0)) == 2  # the first is over 6 h old
    assert len(store.points("key", "k", COARSE_STEP, 0)) == 3


def test_a_node_point_is_the_mean_of_its_gpu_samples() -> None:
    clock = [0.0]
    store = SqliteStore(":memory:")
    rec = recorder(store, clock)
    gib = 2**30

    def gpu(index: int, used: int, utilization: float | None) -> GpuReport:
        return GpuReport(index=index, model="H100", memory_total=80 * gib,
                         memory_used=used * gib, utilization=utilization)  # fmt: skip

    rec.gpus("n", NodeUse.of([gpu(0, 10, 50), gpu(1, 30, 100)]))
    rec.gpus("n", NodeUse.of([gpu(0, 20, 0), gpu(1, 20, None)]))  # GPU 1 says nothing
    rec.gpus("cpu", NodeUse.of([gpu(0, 0, None)]))  # no utilisation said at all
    clock[0] += 10
    asyncio.run(rec.write())
    [node] = store.points("node", "n", 10, 0)
    assert shown_node(Totals.loads(node.body), 10) == {
        "memory_used_gib": 40.0,
        "memory_total_gib": 160.0,
        "utilization_pct": 37.5,  # (75 + 0) / 2: a GPU that says nothing is left out
    }
    [cpu] = store.points("node", "cpu", 10, 0)
    assert shown_node(Totals.loads(cpu.body), 10)["utilization_pct"] is None


@given(
    counts=st.dictionaries(st.integers(0, 2000), st.integers(0, 50), max_size=300),
    span=st.sampled_from(sorted(RANGES.values())),
)
def test_a_plot_merges_points_without_losing_or_inventing_a_request(
    counts: dict[int, int], span: int
) -> None:
    """However many points a range holds, it shows at most MAX_SHOWN, and every request of a
    point inside the range is in exactly one of them (rate times the time covered adds back
    up)."""
    step = 60 if span <= FINE_KEEP_S else COARSE_STEP
    now = 2100 * step
    points = [
        StoredPoint("key", "k", step, i * step, Totals({"requests": float(n)}).dumps())
        for i, n in sorted(counts.items())
    ]
    got = shown("key", points, span, now)
    assert len(got) <= MAX_SHOWN
    width = max(1, -(-span // step // MAX_SHOWN)) * step  # the seconds a shown point covers
    inside = sum(n for i, n in counts.items() if i * step + step > now - span)
    assert all(p.at % width == 0 for p in got)
    assert all(b.at > a.at for a, b in itertools.pairwise(got))  # one point per time, in order
    total = sum((p.values["requests_per_s"] or 0) * p.seconds for p in got)
    assert abs(total - inside) < 1e-6 * max(1, inside)


@given(
    rate=st.floats(0.01, 1000.0),
    span=st.sampled_from(sorted(RANGES.values())),
    ended=st.integers(1, 2000),
    missing=st.sets(st.integers(0, 400), max_size=100),
    said=st.booleans(),
)
def test_a_steady_rate_is_plotted_as_that_rate_whatever_a_point_s_fill(
    rate: float, span: int, ended: int, missing: set[int], said: bool
) -> None:
    """Issue 57: a point was divided by its whole width, so the last hour's point, a quarter
    full, showed 4.2 req/s for a steady 8.5, and points spanning a restart (steps with no
    point) 10/12 of the truth. Whatever the steps present, a steady rate shows as itself."""
    step = 60 if span <= FINE_KEEP_S else COARSE_STEP
    now = ended * step
    points = []
    for i in range(max(0, ended - span // step - 1), ended):
        if ended - 1 - i in missing:
            continue  # a step the control plane was down for: no point
        counts = {"requests": rate * step, "tokens": 3 * rate * step}
        if said:  # as points say the seconds they cover; older ones do not
            counts[COVERED] = float(step)
        points.append(StoredPoint("model", "m", step, i * step, Totals(counts).dumps()))
    for p in shown("model", points, span, now):
        assert p.values["requests_per_s"] == pytest.approx(rate)
        assert p.values["tokens_per_s"] == pytest.approx(3 * rate)


def test_a_quarter_still_filling_covers_the_steps_written_so_far() -> None:
    """The day's range plots quarter-hour points: the current one, 3 steps of 10 s into its
    quarter, covers 30 s, and a key that counted nothing in a step of this term gets a zero
    point for it (its rate is over every step of the term, not only the busy ones)."""
    clock = [1800.0 + 5]
    store = SqliteStore(":memory:")
    rec = recorder(store, clock)

    async def go() -> None:
        for requests in (30, 0, 60):
            if requests:
                rec.add("key", "k", Totals({"requests": requests}))
            clock[0] += 10
            await rec.write()

    asyncio.run(go())
    fine = store.points("key", "k", 10, 0)
    assert [Totals.loads(p.body).count("requests") for p in fine] == [30, 0, 60]
    [quarter] = store.points("key", "k", COARSE_STEP, 0)
    assert Totals.loads(quarter.body).count(COVERED) == 30
    [day] = shown("key", [quarter], RANGES["24h"], clock[0])
    assert day.values["requests_per_s"] == 3.0 and day.seconds == 30


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
    shown_ = shown_model(Totals.loads(since.dumps()), 10.0)  # as written and read back
    assert shown_["first_byte_p50"] == 0.1 and shown_["request_p99"] is None
    assert shown_["first_byte_p99"] == 1.0


@pytest.mark.parametrize("landed", [True, False])
def test_a_failed_write_loses_its_step_and_the_quarter_is_read_again(landed: bool) -> None:
    """A write that failed may have landed (its answer lost) or not: the next one reads the
    quarter's point back rather than adding to what it held, so that either way the quarter
    is the sum of the steps the store holds, none counted twice."""

    class Flaky(SqliteStore):
        fail = 0

        def put_points(self, points: Sequence[StoredPoint], forget: Mapping[int, float]) -> None:
            if self.fail and not landed:
                self.fail -= 1
                raise StoreError("the store is gone")
            super().put_points(points, forget)
            if self.fail:
                self.fail -= 1
                raise StoreError("the answer was lost")

    clock = [1800.0]
    store = Flaky(":memory:")
    rec = recorder(store, clock)

    async def go() -> None:
        for requests, fail in ((1, 0), (2, 1), (4, 0)):
            store.fail = fail
            rec.add("model", "m", Totals({"requests": requests}))
            clock[0] += 10
            await rec.write()

    asyncio.run(go())
    assert rec.written == 2
    steps = [Totals.loads(p.body).count("requests") for p in store.points("model", "m", 10, 0)]
    assert steps == ([1, 2, 4] if landed else [1, 4])
    [quarter] = store.points("model", "m", COARSE_STEP, 0)
    assert Totals.loads(quarter.body).count("requests") == sum(steps)
