"""llama.cpp: the native `llama-server` when it is on PATH, otherwise llama-cpp-python's
`python -m llama_cpp.server`. SOURCE is the path of a GGUF file. One shard per replica (the
catalog refuses more); every layer is offloaded to the shard's GPUs when there are any. A
`program` (catalog or node) naming `llama_cpp.server` is run with that server's flags, any
other with `llama-server`'s."""

from __future__ import annotations

import shutil
import sys

from modelfleet.engines.base import AdapterApi, Launch, NoDriver, Start, gpu_env, importable


class LlamaCppDriver:
    name = "llamacpp"
    adapter_api: AdapterApi | None = None

    def launch(self, start: Start) -> Launch:
        shard, host, port = start.shard, start.host, str(start.port)
        program = start.program(_found)
        if "llama_cpp.server" not in program:  # the native server
            argv = [*program, "--model", shard.source, "--host", host, "--port", port]
            argv += ["--alias", shard.model, "--n-gpu-layers", "999"]
            env = {**gpu_env(shard), "LLAMA_API_KEY": start.key}
            return Launch([*argv, *shard.args], env, "/health")
        argv = [*program, "--model", shard.source]
        argv += ["--host", host, "--port", port, "--model_alias", shard.model]
        argv += ["--n_gpu_layers", "-1"]
        # By default it cuts a running stream short whenever another request comes in.
        argv += ["--interrupt_requests", "false"]
        # It has no /health, and its model list waits behind every generation queued (one
        # lock for all), so a busy server failed its liveness probes and was restarted. It
        # loads its model before it listens: its OpenAPI page answering means it is up.
        env = {**gpu_env(shard), "API_KEY": start.key}  # its settings read the environment
        return Launch([*argv, *shard.args], env, "/openapi.json")


def _found() -> list[str]:
    """`llama-server` from PATH, else llama-cpp-python's server in the agent's Python."""
    native = shutil.which("llama-server")
    if native is not None:
        return [native]
    try:
        importable("llama_cpp", "llama-cpp-python")
    except NoDriver as exc:
        raise NoDriver(f"no llama.cpp here: no llama-server on PATH, and {exc}") from None
    return [sys.executable, "-m", "llama_cpp.server"]
