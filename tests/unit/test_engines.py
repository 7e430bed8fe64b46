"""Engine drivers: the command line, environment and readiness probe each gives a shard."""

from __future__ import annotations

import sys

import pytest

from modelfleet.engines import NoDriver, driver_for
from modelfleet.engines import llamacpp as llamacpp_module
from modelfleet.engines import vllm as vllm_module
from modelfleet.wire import ShardAssignment


def shard(engine: str, rank: int = 0, num_shards: int = 1, **kw: object) -> ShardAssignment:
    fields: dict[str, object] = {
        "replica_id": "r",
        "model": "llama-3-8b",
        "engine": engine,
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "args": ["--max-model-len", "8192"],
        "env": {"HF_HOME": "/models"},
        "rank": rank,
        "num_shards": num_shards,
        "gpus": [2, 3],
        "engine_digest": "d",
        "startup_timeout": 600,
        **kw,
    }
    return ShardAssignment.model_validate(fields)


def test_vllm_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: f"/usr/bin/{name}")
    launch = driver_for("vllm").launch(shard("vllm"), "10.0.0.5", 8001, None, "k")
    assert launch.argv == [
        "/usr/bin/vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "10.0.0.5", "--port", "8001", "--served-model-name", "llama-3-8b",
        "--tensor-parallel-size", "2", "--max-model-len", "8192",
    ]  # fmt: skip
    assert launch.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "HF_HOME": "/models",
        "VLLM_API_KEY": "k",  # by environment: `ps` shows no key
    }
    assert launch.health_path == "/health"


def test_vllm_across_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: name)
    lead = driver_for("vllm").launch(shard("vllm", 0, 2), "10.0.0.5", 8001, "10.0.0.5:29500", "k")
    assert lead.argv[lead.argv.index("--pipeline-parallel-size") + 1] == "2"
    assert " ".join(lead.argv).count("--nnodes 2 --node-rank 0") == 1
    assert "--master-addr 10.0.0.5 --master-port 29500" in " ".join(lead.argv)
    assert "--headless" not in lead.argv and lead.health_path == "/health"
    worker = driver_for("vllm").launch(shard("vllm", 1, 2), "10.0.0.6", 8002, "10.0.0.5:29500", "k")
    assert "--node-rank 1" in " ".join(worker.argv) and "--headless" in worker.argv
    assert (lead.env["VLLM_HOST_IP"], worker.env["VLLM_HOST_IP"]) == ("10.0.0.5", "10.0.0.6")
    assert worker.health_path is None  # a headless worker serves no HTTP
    with pytest.raises(NoDriver, match="no address of shard 0"):
        driver_for("vllm").launch(shard("vllm", 1, 2), "10.0.0.6", 8002, None, "k")


def test_vllm_not_installed_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NoDriver, match="`vllm` is not on this node's PATH"):
        driver_for("vllm").launch(shard("vllm"), "h", 1, None, "k")


def test_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("modelfleet.engines.sglang.importable", lambda *_: None)
    one = driver_for("sglang").launch(shard("sglang"), "h", 9000, None, "k")
    assert one.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert "--tp-size 2" in " ".join(one.argv) and "--nnodes" not in one.argv
    two = driver_for("sglang").launch(shard("sglang", 1, 2), "h", 9000, "10.0.0.5:29500", "k")
    text = " ".join(two.argv)
    assert "--tp-size 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.5:29500" in text
    assert two.health_path is None


def test_llamacpp_prefers_the_native_server(monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = shard("llamacpp", source="/models/m.gguf", args=[])
    monkeypatch.setattr(llamacpp_module.shutil, "which", lambda name: "/opt/bin/llama-server")
    native = driver_for("llamacpp").launch(gguf, "h", 7000, None, "k")
    assert native.argv[:3] == ["/opt/bin/llama-server", "--model", "/models/m.gguf"]
    assert "--alias" in native.argv and native.health_path == "/health"
    monkeypatch.setattr(llamacpp_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(llamacpp_module, "importable", lambda *_: None)
    python = driver_for("llamacpp").launch(gguf, "h", 7000, None, "k")
    assert python.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert python.health_path == "/v1/models"

    def missing(*_: object) -> None:
        raise NoDriver("llama-cpp-python is not installed")

    monkeypatch.setattr(llamacpp_module, "importable", missing)
    with pytest.raises(NoDriver, match="no llama-server on PATH"):
        driver_for("llamacpp").launch(gguf, "h", 7000, None, "k")


def test_an_unknown_engine_has_no_driver() -> None:
    with pytest.raises(NoDriver, match="no driver for engine 'tgi'"):
        driver_for("tgi")


def test_a_model_with_adapters_starts_engines_that_load_them_at_run_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: name)
    monkeypatch.setattr("modelfleet.engines.sglang.importable", lambda *_: None)
    lora = {"max_loras": 4, "max_lora_rank": 64, "adapters": {"sql": "/lora/sql"}}
    vllm = driver_for("vllm").launch(shard("vllm", **lora), "h", 9000, None, "k")
    assert "--enable-lora --max-loras 4 --max-lora-rank 64" in " ".join(vllm.argv)
    assert vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # load_lora_adapter served
    sglang = driver_for("sglang").launch(shard("sglang", **lora), "h", 9000, None, "k")
    text = " ".join(sglang.argv)
    assert "--enable-lora --max-lora-rank 64 --max-loras-per-batch 4 --max-loaded-loras 4" in text
    sim = driver_for("sim").launch(shard("sim", **lora), "h", 9000, None, "k")
    assert "--enable-lora --max-loras 4" in " ".join(sim.argv)
    # Where each loads them; an engine without run-time loading says so.
    apis = {name: driver_for(name).adapter_api for name in ("vllm", "sglang", "sim", "llamacpp")}
    assert {n: a.load if a else None for n, a in apis.items()} == {
        "vllm": "/v1/load_lora_adapter", "sglang": "/load_lora_adapter",
        "sim": "/v1/load_lora_adapter", "llamacpp": None}  # fmt: skip
    plain = driver_for("vllm").launch(shard("vllm"), "h", 9000, None, "k")
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
