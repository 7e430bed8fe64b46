"""vLLM: `vllm serve SOURCE`, tensor parallel over the shard's GPUs.

A replica of several shards runs one `vllm serve` per node with vLLM's own multi-node flags:
tensor parallel inside each node, pipeline parallel across the nodes (`--pipeline-parallel-size`
= shards), `--nnodes`, `--node-rank` and shard 0's rendezvous as `--master-addr` /
`--master-port`; the shards of rank 1 and up run `--headless` and serve no HTTP.

On a CPU node each rank's threads are bound to the cores of its slot
(`VLLM_CPU_OMP_THREADS_BIND`).

Told to stop (SIGTERM), vLLM finishes the requests in flight for up to `--shutdown-timeout`
seconds; without it (its default, 0) it aborts them.
"""

from __future__ import annotations

from modelfleet.engines.base import (
    VLLM_ADAPTERS,
    AdapterApi,
    Launch,
    Start,
    core_list,
    executable,
    gpu_env,
    split_leader,
)


class VllmDriver:
    name = "vllm"
    adapter_api: AdapterApi | None = VLLM_ADAPTERS

    def launch(self, start: Start) -> Launch:
        shard, host, port = start.shard, start.host, start.port
        argv = [*start.program(lambda: [executable("vllm")]), "serve", shard.source]
        argv += ["--host", host, "--port", str(port), "--served-model-name", shard.model]
        argv += ["--shutdown-timeout", str(start.drain_s)]
        argv += ["--tensor-parallel-size", str(len(shard.gpus))]
        health: str | None = "/health"
        peers: dict[str, str] = {}
        if shard.num_shards > 1:
            # The address its peers reach it at, not a guess.
            peers["VLLM_HOST_IP"] = start.address or host
            master_host, master_port = split_leader(shard, start.leader)
            argv += ["--pipeline-parallel-size", str(shard.num_shards)]
            argv += ["--nnodes", str(shard.num_shards), "--node-rank", str(shard.rank)]
            argv += ["--master-addr", master_host, "--master-port", master_port]
            if shard.rank > 0:
                argv.append("--headless")
                health = None
        if shard.sleep_mode:
            # vLLM serves POST /sleep and /wake_up only in its server's dev mode.
            argv.append("--enable-sleep-mode")
            peers["VLLM_SERVER_DEV_MODE"] = "1"
        if shard.max_loras is not None:
            argv += ["--enable-lora", "--max-loras", str(shard.max_loras)]
            argv += ["--max-lora-rank", str(shard.max_lora_rank)]
            peers["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # load_lora_adapter served
        if start.cores:
            # vLLM's CPU build binds each tensor-parallel rank's threads to these cores, one
            # slot per rank; left to itself ("auto") every replica binds the same cores.
            peers["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(core_list(c) for c in start.cores)
        env = {**peers, **gpu_env(shard), "VLLM_API_KEY": start.key}  # the catalog sets no key
        return Launch([*argv, *shard.args], env, health)
