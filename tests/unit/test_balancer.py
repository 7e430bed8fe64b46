"""The router's choice of replica, as pure logic: load, ejection on a moved clock, prefixes."""

from __future__ import annotations

import math
import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from modelfleet.router.balancer import Balancer
from modelfleet.router.engine_load import read_cache_usage, read_engine_load

ENDPOINTS = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]


def test_of_two_the_less_loaded_is_taken_counting_the_engines_own_queue() -> None:
    balancer = Balancer(rng=random.Random(1))
    a, b = ENDPOINTS[:2]
    balancer.begin(a)  # one of this router's requests at a
    balancer.set_engine_load(b, 5)  # and five at b's engine, from other routers
    assert balancer.state[a].load == 1 and balancer.state[b].load == 5
    assert {balancer.pick([a, b]) for _ in range(20)} == {a}
    balancer.end(a)
    balancer.set_engine_load(b, 0)
    picked = Counter(balancer.pick([a, b]) for _ in range(200))
    assert picked[a] > 50 and picked[b] > 50  # ties go either way


@given(
    loads=st.lists(st.integers(0, 20), min_size=2, max_size=8),
    ejected=st.sets(st.integers(0, 7)),
    tried=st.sets(st.integers(0, 7)),
    seed=st.integers(0, 2**32),
)
def test_a_pick_is_never_ejected_nor_tried_and_beats_half_the_field(
    loads: list[int], ejected: set[int], tried: set[int], seed: int
) -> None:
    endpoints = ENDPOINTS[: len(loads)]
    balancer = Balancer(rng=random.Random(seed))
    for endpoint, load in zip(endpoints, loads, strict=True):
        balancer.set_engine_load(endpoint, load)
    for i in ejected & set(range(len(endpoints))):
        for _ in range(3):
            balancer.failed(endpoints[i], now=0.0)
    out = {endpoints[i] for i in ejected | tried if i < len(endpoints)}
    picked = balancer.pick(endpoints, exclude=[endpoints[i] for i in tried if i < len(endpoints)])
    left = [e for e in endpoints if e not in out]
    if not left:
        assert picked is None
        return
    assert picked in left
    # The less loaded of two: never the single most loaded one when there is a choice.
    if len(left) > 1:
        worst = max(balancer.state[e].load for e in left)
        strictly_worst = [e for e in left if balancer.state[e].load == worst]
        if len(strictly_worst) == 1:
            assert picked != strictly_worst[0]


def test_ejection_lasts_a_while_doubles_and_ends_only_with_a_healthy_probe() -> None:
    balancer = Balancer()
    e = ENDPOINTS[0]
    assert not balancer.failed(e, now=100.0) and not balancer.failed(e, now=100.0)
    balancer.succeeded(e)  # a success between: the count starts again
    assert not balancer.failed(e, 100.0) and not balancer.failed(e, 100.0)
    assert balancer.failed(e, 100.0)  # the third in a row
    assert not balancer.usable(e) and balancer.pick([e]) is None
    assert balancer.probe_due(104.9) == [] and balancer.probe_due(105.0) == [e]
    balancer.probed(e, healthy=False, now=105.0)  # still failing: out for twice as long
    assert balancer.state[e].ejected_until == 115.0 and balancer.probe_due(114.0) == []
    balancer.probed(e, healthy=True, now=115.0)
    assert balancer.usable(e) and balancer.pick([e]) == e
    for _ in range(3):
        balancer.failed(e, 120.0)
    assert balancer.state[e].ejected_until == 140.0  # no success since: 20 s
    balancer.probed(e, healthy=True, now=140.0)
    balancer.succeeded(e)
    for _ in range(3):
        balancer.failed(e, 200.0)
    assert balancer.state[e].ejected_until == 205.0  # a success between: back to 5 s


def test_prompts_sharing_a_prefix_meet_at_one_replica_until_it_is_busier_than_the_bound() -> None:
    balancer = Balancer()
    prefixes = [f"system prompt number {i}".encode() for i in range(40)]
    homes = {p: balancer.pick(ENDPOINTS, prefix=p) for p in prefixes}
    assert all(balancer.pick(ENDPOINTS, prefix=p) == homes[p] for p in prefixes)  # stable
    assert len(set(homes.values())) >= 4  # and spread over the replicas
    # Its home fills up: once over the bound, the prefix goes elsewhere.
    p = prefixes[0]
    home = homes[p]
    for _ in range(4):  # 4 more than the least loaded: still within the bound
        balancer.begin(home)
    assert balancer.pick(ENDPOINTS, prefix=p) == home
    balancer.begin(home)
    assert balancer.pick(ENDPOINTS, prefix=p) != home
    balancer.set_engine_load(home, 9)  # the engine's own count, from other routers too
    for _ in range(5):
        balancer.end(home)
    assert balancer.pick(ENDPOINTS, prefix=p) != home
    balancer.set_engine_load(home, 0)
    # A replica leaving the table moves only the prefixes it was home to.
    smaller = [e for e in ENDPOINTS if e != home]
    moved = [q for q in prefixes if balancer.pick(smaller, prefix=q) != homes[q]]
    assert all(homes[q] == home for q in moved)


@given(
    loads=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    prefix=st.binary(min_size=1, max_size=64),
)
def test_a_prefix_pick_stays_within_the_load_bound(loads: list[int], prefix: bytes) -> None:
    endpoints = ENDPOINTS[: len(loads)]
    balancer = Balancer()
    for endpoint, load in zip(endpoints, loads, strict=True):
        balancer.set_engine_load(endpoint, load)
    picked = balancer.pick(endpoints, prefix=prefix)
    assert picked is not None
    least = min(loads)
    assert loads[endpoints.index(picked)] <= max(least + 4, math.floor(least * 1.5))
    # and the prefix's home on the ring takes it whenever it is within that bound


def test_engine_load_is_read_from_each_engines_own_metric_names() -> None:
    vllm = (
        "# HELP vllm:num_requests_running Requests.\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{model_name="m"} 2.0\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 40.0\n'
    )
    assert read_engine_load(vllm) == 6
    assert read_engine_load("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n") == 5
    assert read_engine_load("llamacpp:requests_processing 1\n") == 1
    assert read_engine_load("process_cpu_seconds_total 9.0\n") is None
    assert read_engine_load("vllm:num_requests_running NaN\n") is None


def test_an_engine_s_kv_cache_in_use_is_read_by_each_engine_s_own_name() -> None:
    """Issue 41: the KV cache in use per replica, which the vLLM board shows."""
    two = 'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.5\n'
    assert read_cache_usage(two) == 0.5  # the fuller of its engines
    assert read_cache_usage("sglang:token_usage 0.125\n") == 0.125
    assert read_cache_usage("vllm:gpu_cache_usage_perc 1.7\n") == 1.0  # a share, at most all
    assert read_cache_usage("vllm:num_requests_running 3\n") is None
