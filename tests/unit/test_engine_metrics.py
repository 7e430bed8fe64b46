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
