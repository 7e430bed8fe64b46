"""Engine drivers: the command line, environment and readiness probe each gives a shard."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from modelfleet.engines import Launch, NoDriver, driver_for
from modelfleet.engines import llamacpp as llamacpp_module
from modelfleet.engines import vllm as vllm_module
from modelfleet.engines.base import Start
from modelfleet.messages.wire import ShardAssignment


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


def launch(s: ShardAssignment, host: str, port: int, leader: str | None, **kw: object) -> Launch:
    """What the driver for `s.engine` starts for `s`, its engine's key being "k"."""
    return driver_for(s.engine).launch(Start(s, host, port, "k", leader=leader, **kw))  # type: ignore[arg-type]


def test_vllm_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: f"/usr/bin/{name}")
    started = launch(shard("vllm"), "10.0.0.5", 8001, None)
    assert started.argv == [
        "/usr/bin/vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "10.0.0.5", "--port", "8001", "--served-model-name", "llama-3-8b",
        "--shutdown-timeout", "24", "--tensor-parallel-size", "2", "--max-model-len", "8192",
    ]  # fmt: skip
    assert started.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "HF_HOME": "/models",
        "VLLM_API_KEY": "k",  # by environment: `ps` shows no key
    }
    assert started.health_path == "/health"


def test_vllm_across_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: name)
    lead = launch(shard("vllm", 0, 2), "10.0.0.5", 8001, "10.0.0.5:29500")
    assert lead.argv[lead.argv.index("--pipeline-parallel-size") + 1] == "2"
    assert " ".join(lead.argv).count("--nnodes 2 --node-rank 0") == 1
    assert "--master-addr 10.0.0.5 --master-port 29500" in " ".join(lead.argv)
    assert "--headless" not in lead.argv and lead.health_path == "/health"
    worker = launch(shard("vllm", 1, 2), "10.0.0.6", 8002, "10.0.0.5:29500")
    assert "--node-rank 1" in " ".join(worker.argv) and "--headless" in worker.argv
    assert (lead.env["VLLM_HOST_IP"], worker.env["VLLM_HOST_IP"]) == ("10.0.0.5", "10.0.0.6")
    assert worker.health_path is None  # a headless worker serves no HTTP
    with pytest.raises(NoDriver, match="no address of shard 0"):
        launch(shard("vllm", 1, 2), "10.0.0.6", 8002, None)


def test_vllm_not_installed_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NoDriver, match="`vllm` is not on this node's PATH"):
        launch(shard("vllm"), "h", 1, None)


def test_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("modelfleet.engines.sglang.importable", lambda *_: None)
    one = launch(shard("sglang"), "h", 9000, None)
    assert one.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert "--tp-size 2" in " ".join(one.argv) and "--nnodes" not in one.argv
    two = launch(shard("sglang", 1, 2), "h", 9000, "10.0.0.5:29500")
    text = " ".join(two.argv)
    assert "--tp-size 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.5:29500" in text
    assert two.health_path is None


def test_llamacpp_prefers_the_native_server(monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = shard("llamacpp", source="/models/m.gguf", args=[])
    monkeypatch.setattr(llamacpp_module.shutil, "which", lambda name: "/opt/bin/llama-server")
    native = launch(gguf, "h", 7000, None)
    assert native.argv[:3] == ["/opt/bin/llama-server", "--model", "/models/m.gguf"]
    assert "--alias" in native.argv and native.health_path == "/health"
    monkeypatch.setattr(llamacpp_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(llamacpp_module, "importable", lambda *_: None)
    python = launch(gguf, "h", 7000, None)
    assert python.argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    # Its model list waits behind every queued generation: a busy server would look dead.
    assert python.health_path == "/openapi.json"
    assert " --interrupt_requests false" in " ".join(python.argv)  # else streams cut each other

    def missing(*_: object) -> None:
        raise NoDriver("llama-cpp-python is not installed")

    monkeypatch.setattr(llamacpp_module, "importable", missing)
    with pytest.raises(NoDriver, match="no llama-server on PATH"):
        launch(gguf, "h", 7000, None)


def test_an_unknown_engine_has_no_driver() -> None:
    with pytest.raises(NoDriver, match="no driver for engine 'tgi'"):
        driver_for("tgi")


def test_a_model_with_adapters_starts_engines_that_load_them_at_run_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: name)
    monkeypatch.setattr("modelfleet.engines.sglang.importable", lambda *_: None)
    lora = {"max_loras": 4, "max_lora_rank": 64, "adapters": {"sql": "/lora/sql"}}
    vllm = launch(shard("vllm", **lora), "h", 9000, None)
    assert "--enable-lora --max-loras 4 --max-lora-rank 64" in " ".join(vllm.argv)
    assert vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # load_lora_adapter served
    sglang = launch(shard("sglang", **lora), "h", 9000, None)
    text = " ".join(sglang.argv)
    # Without --lora-target-modules (or --lora-paths) SGLang refuses to start with LoRA.
    assert "--enable-lora --max-lora-rank 64 --lora-target-modules all" in text
    assert "--max-loras-per-batch 4 --max-loaded-loras 4" in text
    sim = launch(shard("sim", **lora), "h", 9000, None)
    assert "--enable-lora --max-loras 4" in " ".join(sim.argv)
    # Where each loads them; an engine without run-time loading says so.
    apis = {name: driver_for(name).adapter_api for name in ("vllm", "sglang", "sim", "llamacpp")}
    assert {n: a.load if a else None for n, a in apis.items()} == {
        "vllm": "/v1/load_lora_adapter", "sglang": "/load_lora_adapter",
        "sim": "/v1/load_lora_adapter", "llamacpp": None}  # fmt: skip
    # What each holds is read back from its model list, not trusted from the loads.
    assert {n: a.listed if a else None for n, a in apis.items()} == {
        "vllm": "/v1/models", "sglang": "/v1/models", "sim": "/v1/models",
        "llamacpp": None}  # fmt: skip
    plain = launch(shard("vllm"), "h", 9000, None)
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env


def test_vllm_is_told_to_finish_what_is_in_flight_within_the_stop_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: name)
    for grace, drain in ((30.0, "24"), (10.0, "8"), (1.0, "1"), (0.2, "1")):
        argv = launch(shard("vllm"), "h", 1, None, stop_grace=grace).argv
        assert argv[argv.index("--shutdown-timeout") + 1] == drain
    # The catalog's own comes after it, and vLLM takes the last one given.
    argv = launch(shard("vllm", args=["--shutdown-timeout", "5"]), "h", 1, None).argv
    assert argv[-2:] == ["--shutdown-timeout", "5"]


def test_the_program_is_the_catalogs_then_the_nodes_then_the_drivers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(vllm_module, "executable", lambda name: f"/usr/bin/{name}")
    model_vllm, node_vllm = tmp_path / "model" / "vllm", tmp_path / "node" / "vllm"
    for program in (model_vllm, node_vllm):
        program.parent.mkdir()
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    node = {"vllm": str(node_vllm), "sglang": f"{sys.executable} -m sglang.launch_server"}
    assert launch(shard("vllm"), "h", 1, None).argv[0] == "/usr/bin/vllm"
    assert launch(shard("vllm"), "h", 1, None, programs=node).argv[:2] == [str(node_vllm), "serve"]
    own = shard("vllm", program=f"{model_vllm} --flag")
    assert launch(own, "h", 1, None, programs=node).argv[:3] == [str(model_vllm), "--flag", "serve"]
    # A node's program for SGLang runs as given, whether the agent's Python has SGLang or not.
    sglang = launch(shard("sglang"), "h", 1, None, programs=node).argv
    assert sglang[:4] == [sys.executable, "-m", "sglang.launch_server", "--model-path"]
    llama = shard(
        "llamacpp", source="/m.gguf", args=[], program=f"{sys.executable} -m llama_cpp.server"
    )
    assert "--model_alias" in launch(llama, "h", 1, None).argv  # llama-cpp-python's flags
    with pytest.raises(NoDriver, match=r"catalog's program for 'llama-3-8b' is '/opt/none/vllm'"):
        launch(shard("vllm", program="/opt/none/vllm"), "h", 1, None)
    with pytest.raises(NoDriver, match=r"this node's --engine-program vllm=\.\.\. is 'nope'"):
        launch(shard("vllm"), "h", 1, None, programs={"vllm": "nope"})
