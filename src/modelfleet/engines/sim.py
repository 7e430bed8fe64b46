"""The engine simulator (`modelfleet engine-sim`), run with the agent's own Python."""

from __future__ import annotations

import sys

from modelfleet.engines.base import ENGINE_KEY_ENV, VLLM_ADAPTERS, AdapterApi, Launch, gpu_env
from modelfleet.wire import ShardAssignment


class SimDriver:
    name = "sim"
    adapter_api: AdapterApi | None = VLLM_ADAPTERS

    def launch(
        self,
        shard: ShardAssignment,
        host: str,
        port: int,
        leader: str | None,
        key: str,
        address: str | None = None,
    ) -> Launch:
        argv = [sys.executable, "-m", "modelfleet", "engine-sim", "--model", shard.model]
        argv += ["--host", host, "--port", str(port)]
        if shard.sleep_mode:
            argv.append("--enable-sleep-mode")
        if shard.max_loras is not None:
            argv += ["--enable-lora", "--max-loras", str(shard.max_loras)]
        argv += shard.args
        return Launch(argv, {**gpu_env(shard), ENGINE_KEY_ENV: key})
