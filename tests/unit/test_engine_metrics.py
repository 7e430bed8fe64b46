"""Engines' own metrics under one set of names (`engine_metrics.py`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from modelfleet.http.engine_metrics import MAPPING_VERSION, load_sources, translate

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 2.0
vllm:num_requests_running{model_name="m",engine="1"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 200.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 50.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5
vllm:time_to_first_token_seconds_count{model_name="m"} 5.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="s"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="s"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="s"} 0.25
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="s"} 0.75
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_every_engine_s_own_names_come_out_as_one_set() -> None:
    pages = [
        ({"model": "m", "replica": "m-1", "node": "n1"}, VLLM),
        ({"model": "s", "replica": "s-1", "node": "n1"}, SGLANG),
        ({"model": "l", "replica": "l-1", "node": "n2"}, LLAMACPP),
    ]
    got = {
        (s.name, s.labels.get("replica", ""), s.labels.get("le", "")): s.value
        for family in text_string_to_metric_families(translate(pages).decode())
        for s in family.samples
    }
    assert got[("modelfleet_engine_metrics_mapping", "", "")] == MAPPING_VERSION
    assert got[("modelfleet_engine_requests_running", "m-1", "")] == 3  # its label sets summed
    assert got[("modelfleet_engine_requests_running", "s-1", "")] == 7
    assert got[("modelfleet_engine_requests_running", "l-1", "")] == 1
    assert got[("modelfleet_engine_requests_waiting", "m-1", "")] == 4
    assert got[("modelfleet_engine_kv_cache_usage_ratio", "m-1", "")] == 0.5
    assert got[("modelfleet_engine_kv_cache_usage_ratio", "s-1", "")] == 0.25
    assert got[("modelfleet_engine_prefix_cache_hit_ratio", "m-1", "")] == 0.25  # 50 of 200
    assert got[("modelfleet_engine_prefix_cache_hit_ratio", "s-1", "")] == 0.75
    assert got[("modelfleet_engine_time_to_first_token_seconds_bucket", "m-1", "0.1")] == 3
    assert got[("modelfleet_engine_time_to_first_token_seconds_count", "m-1", "")] == 5
    assert ("modelfleet_engine_kv_cache_usage_ratio", "l-1", "") not in got  # not said


def test_the_router_reads_load_from_the_same_names() -> None:
    assert {"vllm:num_requests_running", "sglang:num_queue_reqs"} <= load_sources()
    assert "vllm:kv_cache_usage_perc" not in load_sources()


def ttft_page(counts: dict[str, float], older: dict[str, float] | None = None) -> str:
    """A vLLM page with a time-to-first-token histogram of two engines (label sets), its
    counts by bound split between them; `older`: a deprecated family shown beside it."""
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    for le, n in counts.items():
        for engine, share in (("0", n - n // 2), ("1", n // 2)):
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",'
                         f'le="{le}",model_name="m"}} {share}')  # fmt: skip
    lines.append(f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {counts["+Inf"]}')
    for le, n in (older or {}).items():
        lines.append(f'vllm:time_per_output_token_seconds_bucket{{le="{le}"}} {n}')
        lines.append(f'vllm:inter_token_latency_seconds_bucket{{le="{le}"}} {n * 10}')
    return VLLM.split("# TYPE vllm:time_to_first_token")[0] + "\n".join(lines) + "\n"


def test_the_router_counts_the_engines_own_times_per_model_as_counters() -> None:
    """Issue 57: the dashboard plotted the routers' time to first byte as time to first token
    (151 vs 75 ms). The router reads the engines' own histograms with their load, and counts
    what each engine counted since its last reading, for the engine's model."""
    from modelfleet.router.engine_load import EngineTimes, read_engine_page

    read = read_engine_page(ttft_page({"0.1": 3, "+Inf": 5}, older={"0.5": 2, "+Inf": 2}))
    assert read.load == 7 and read.cache == 0.5  # as before
    assert read.times["first_token"] == {0.1: 3, float("inf"): 5}  # engines' sets summed
    assert read.times["token_gap"] == {0.5: 20, float("inf"): 20}  # vLLM's name first
    times = EngineTimes()
    times.take("http://e1", "m", read.times)  # the first reading: counting starts here
    assert times.counts == {}
    times.take("http://e1", "m", read_engine_page(ttft_page({"0.1": 10, "+Inf": 15})).times)
    assert times.counts[("m", "first_token")] == {0.1: 7, float("inf"): 10}
    # The engine restarted: all it shows is new.
    times.take("http://e1", "m", read_engine_page(ttft_page({"0.1": 1, "+Inf": 2})).times)
    assert times.counts[("m", "first_token")] == {0.1: 8, float("inf"): 12}
    times.keep_only(set())  # no longer routed to: read again, it starts anew
    times.take("http://e1", "m", read_engine_page(ttft_page({"0.1": 9, "+Inf": 9})).times)
    assert times.counts[("m", "first_token")] == {0.1: 8, float("inf"): 12}


def test_workers_reading_the_same_engines_show_their_largest_reading_not_the_sum() -> None:
    from modelfleet.router.metrics import summed

    def scrape(ttft: float, requests: float) -> str:
        return (
            "# TYPE modelfleet_router_engine_time_to_first_token_seconds histogram\n"
            "modelfleet_router_engine_time_to_first_token_seconds_bucket"
            f'{{model="m",le="+Inf"}} {ttft}\n'
            "# TYPE modelfleet_router_requests counter\n"
            f'modelfleet_router_requests_total{{model="m",status="200"}} {requests}\n'
        )  # fmt: skip

    def read(text: bytes) -> dict[str, float]:
        return {s.name: s.value for f in text_string_to_metric_families(text.decode())
                for s in f.samples}  # fmt: skip

    both = read(summed([scrape(10, 3), scrape(12, 4)], same_engines=True))
    assert both["modelfleet_router_engine_time_to_first_token_seconds_bucket"] == 12
    assert both["modelfleet_router_requests_total"] == 7  # each worker's own: summed
    runs = read(summed([scrape(10, 3), scrape(12, 4)]))  # one worker's runs: summed
    assert runs["modelfleet_router_engine_time_to_first_token_seconds_bucket"] == 22
