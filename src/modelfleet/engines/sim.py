"""The engine simulator (`modelfleet engine-sim`), run with the agent's own Python."""

from __future__ import annotations

import sys

from modelfleet.engines.base import (
    ENGINE_KEY_ENV,
    VLLM_ADAPTERS,
    AdapterApi,
    Launch,
    Start,
    gpu_env,
)


class SimDriver:
    name = "sim"
    adapter_api: AdapterApi | None = VLLM_ADAPTERS

    def launch(self, start: Start) -> Launch:
        shard = start.shard
        argv = [*start.program(lambda: [sys.executable, "-m", "modelfleet", "engine-sim"])]
        argv += ["--model", shard.model, "--host", start.host, "--port", str(start.port)]
        if shard.sleep_mode:
            argv.append("--enable-sleep-mode")
        if shard.max_loras is not None:
            argv += ["--enable-lora", "--max-loras", str(shard.max_loras)]
        argv += shard.args
        return Launch(argv, {**gpu_env(shard), ENGINE_KEY_ENV: start.key})
