"""llama.cpp: the native `llama-server` when it is on PATH, otherwise llama-cpp-python's
`python -m llama_cpp.server`. SOURCE is the path of a GGUF file. One shard per replica (the
catalog refuses more); every layer is offloaded to the shard's GPUs when there are any."""

from __future__ import annotations

import shutil
import sys

from modelfleet.engines.base import AdapterApi, Launch, NoDriver, gpu_env, importable
from modelfleet.wire import ShardAssignment


class LlamaCppDriver:
    name = "llamacpp"
    adapter_api: AdapterApi | None = None

    def launch(
        self,
        shard: ShardAssignment,
        host: str,
        port: int,
        leader: str | None,
        key: str,
        address: str | None = None,
    ) -> Launch:
        native = shutil.which("llama-server")
        if native is not None:
            argv = [native, "--model", shard.source, "--host", host, "--port", str(port)]
            argv += ["--alias", shard.model, "--n-gpu-layers", "999"]
            env = {**gpu_env(shard), "LLAMA_API_KEY": key}
            return Launch([*argv, *shard.args], env, "/health")
        try:
            importable("llama_cpp", "llama-cpp-python")
        except NoDriver as exc:
            raise NoDriver(f"no llama.cpp here: no llama-server on PATH, and {exc}") from None
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", shard.source]
        argv += ["--host", host, "--port", str(port), "--model_alias", shard.model]
        argv += ["--n_gpu_layers", "-1"]
        # llama-cpp-python's server has no /health; its model list answers once it has loaded.
        env = {**gpu_env(shard), "API_KEY": key}  # its settings read the environment
        return Launch([*argv, *shard.args], env, "/v1/models")
