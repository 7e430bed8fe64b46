"""SGLang: `python -m sglang.launch_server`, tensor parallel over every GPU of the replica.

A replica of several shards runs one server per node with `--nnodes`, `--node-rank` and shard
0's rendezvous as `--dist-init-addr`; only shard 0 serves HTTP.
"""

from __future__ import annotations

import sys

from modelfleet.engines.base import AdapterApi, Launch, gpu_env, importable, split_leader
from modelfleet.wire import ShardAssignment


class SglangDriver:
    name = "sglang"
    adapter_api: AdapterApi | None = AdapterApi("/load_lora_adapter", "/unload_lora_adapter")

    def launch(
        self,
        shard: ShardAssignment,
        host: str,
        port: int,
        leader: str | None,
        key: str,
        address: str | None = None,
    ) -> Launch:
        importable("sglang", "SGLang")
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", shard.source]
        argv += ["--host", host, "--port", str(port), "--served-model-name", shard.model]
        argv += ["--api-key", key]  # SGLang reads it from its command line only
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
            argv += ["--max-loras-per-batch", str(shard.max_loras)]
            argv += ["--max-loaded-loras", str(shard.max_loras)]
        return Launch([*argv, *shard.args], gpu_env(shard), health)
