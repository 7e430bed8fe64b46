"""SGLang: `python -m sglang.launch_server`, tensor parallel over every GPU of the replica.

A replica of several shards runs one server per node with `--nnodes`, `--node-rank` and shard
0's rendezvous as `--dist-init-addr`; only shard 0 serves HTTP.
"""

from __future__ import annotations

import sys

from modelfleet.engines.base import AdapterApi, Launch, Start, gpu_env, importable, split_leader


class SglangDriver:
    name = "sglang"
    # SGLang lists what it holds in its model list, as vLLM does (adapters with a `parent`).
    adapter_api: AdapterApi | None = AdapterApi(
        "/load_lora_adapter", "/unload_lora_adapter", "/v1/models"
    )

    def launch(self, start: Start) -> Launch:
        shard, leader = start.shard, start.leader
        argv = [*start.program(_own_python), "--model-path", shard.source]
        argv += ["--host", start.host, "--port", str(start.port)]
        argv += ["--served-model-name", shard.model]
        argv += ["--api-key", start.key]  # SGLang reads it from its command line only
        argv += ["--tp-size", str(len(shard.gpus) * shard.num_shards)]
        health: str | None = "/health"
        if shard.num_shards > 1:
            split_leader(shard, leader)
            argv += ["--nnodes", str(shard.num_shards), "--node-rank", str(shard.rank)]
            argv += ["--dist-init-addr", str(leader)]
            if shard.rank > 0:
                health = None
        if shard.max_loras is not None:
            # Every adapter it holds may be in one batch; the agent keeps at most this many.
            argv += ["--enable-lora", "--max-lora-rank", str(shard.max_lora_rank)]
            # Started with no adapter (`--lora-paths`), SGLang cannot tell which layers they
            # adapt and refuses to start without this; the catalog's `args` may name fewer.
            argv += ["--lora-target-modules", "all"]
            argv += ["--max-loras-per-batch", str(shard.max_loras)]
            argv += ["--max-loaded-loras", str(shard.max_loras)]
        return Launch([*argv, *shard.args], gpu_env(shard), health)


def _own_python() -> list[str]:
    importable("sglang", "SGLang")
    return [sys.executable, "-m", "sglang.launch_server"]
