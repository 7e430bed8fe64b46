"""Every command line the vLLM and SGLang drivers write, checked by the engine's own parser
and validation (tests/vllm/check_argv.py, run by the test venv's python; what each check
covers is said there).

The command lines come from catalog models through the control plane's own assignment and the
agent's driver, for each shape a replica can take: one GPU, tensor parallel, both shards of a
replica across nodes, LoRA at every rank the catalog takes, sleep mode, and the tool-call and
reasoning parsers an operator adds in `args`. TLS is no engine flag: the node's gate speaks it
in front of the engine. The other way round, a LoRA rank the catalog refuses is one vLLM
refuses too; and controls show each check refuses what its engine refuses.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from modelfleet.controlplane.assignments import shard_assignment
from modelfleet.core.catalog import LORA_RANKS, Catalog, CatalogInvalid
from modelfleet.engines.base import EngineDriver, Start
from modelfleet.engines.sglang import SglangDriver
from modelfleet.engines.vllm import VllmDriver

from .vllm_kit import ARGS, TINY, VENV

pytestmark = pytest.mark.real_vllm

CHECK = Path(__file__).resolve().parents[1] / "vllm" / "check_argv.py"
# What vLLM's CPU build refuses for its platform, not for the command line.
CPU_ONLY_REFUSALS = {"sleep": "Sleep mode is not supported on current platform"}


def spec(engine: str = "vllm", **more: Any) -> Any:
    model = {"name": "tiny", "engine": engine, "source": str(TINY / "model"), "args": ARGS}
    if engine != "vllm":
        model["args"] = []
    return Catalog.new([{**model, **more}]).models[0]


Lines = dict[str, tuple[list[str], dict[str, str]]]


def command_lines(driver: EngineDriver, program: str, parsers: list[str]) -> Lines:
    """name -> (the words after `program`, the environment) for each shape of replica."""
    engine = driver.name
    lines: Lines = {}

    def add(name: str, model: Any, gpus: list[int], **where: Any) -> None:
        shard = shard_assignment(model, replica_id=name, gpus=gpus, engine_digest="d", **where)
        start = Start(
            shard, "127.0.0.1", 8000, "engine-key", leader=where.get("leader"),
            address="10.0.0.2", stop_grace=30.0, programs={engine: program},
        )  # fmt: skip
        launch = driver.launch(start)
        words = program.split()
        assert launch.argv[1 : len(words)] == words[1:], launch.argv  # [0]: found on PATH
        lines[name] = (launch.argv[len(words) :], launch.env)

    add("one-gpu", spec(engine), [0], rank=0, num_shards=1)
    add("tensor-parallel", spec(engine, gpus_per_shard=2), [0, 1], rank=0, num_shards=1)
    two = spec(engine, shards=2)
    add("two-shards-rank-0", two, [0], rank=0, num_shards=2, leader="10.0.0.1:29500")
    add("two-shards-rank-1", two, [0], rank=1, num_shards=2, leader="10.0.0.1:29500")
    for rank in LORA_RANKS.get(engine, (8, 24, 64)):
        lora = spec(engine, max_loras=3, max_lora_rank=rank)
        add(f"lora-{rank}", lora, [0], rank=0, num_shards=1)
    if engine == "vllm":
        sleeping = spec(engine, autoscale={"max": 2, "target_in_flight": 4}, idle_action="sleep")
        add("sleep", sleeping, [0], rank=0, num_shards=1)
    add("parsers", spec(engine, args=[*spec(engine).args, *parsers]), [0], rank=0, num_shards=1)
    return lines


def verdicts(engine: str, cases: Lines, tmp: Path) -> Any:
    listed = [{"name": n, "argv": argv, "env": env} for n, (argv, env) in cases.items()]
    (tmp / "cases.json").write_text(json.dumps(listed))
    ran = subprocess.run(
        [str(VENV / "bin" / "python"), str(CHECK), engine, str(tmp / "cases.json"),
         str(tmp / "out.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    found = json.loads((tmp / "out.json").read_text())
    assert set(found) == set(cases)
    return found


def judge(found: dict[str, str | None], cases: Lines, platform: dict[str, str]) -> None:
    for name, refusal in found.items():
        if name.startswith("control-"):
            assert refusal, f"the engine took {name}: {cases[name][0]}"
        elif name in platform:
            assert refusal is None or platform[name] in refusal, (name, refusal)
        else:
            assert refusal is None, f"the engine refused {name}: {refusal}\n{cases[name][0]}"


def test_vllm_takes_every_command_line_the_driver_writes(vllm: Path, tmp_path: Path) -> None:
    parsers = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    parsers += ["--reasoning-parser", "deepseek_r1"]
    cases = command_lines(VllmDriver(), str(vllm), parsers)
    one_gpu = cases["one-gpu"][0]
    cases["control-unknown-flag"] = ([*one_gpu, "--no-such-flag"], {})
    for rank in (2, 24, 1024):
        with pytest.raises(CatalogInvalid, match="max_lora_rank"):
            spec(max_loras=3, max_lora_rank=rank)
        lora = ["--enable-lora", "--max-lora-rank", str(rank)]
        cases[f"control-rank-{rank}"] = ([*one_gpu, *lora], {})
    judge(verdicts("vllm", cases, tmp_path), cases, CPU_ONLY_REFUSALS)


def test_sglang_takes_every_command_line_the_driver_writes(vllm: Path, tmp_path: Path) -> None:
    parsers = ["--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1"]
    cases = command_lines(SglangDriver(), "python3 -m sglang.launch_server", parsers)
    cases["control-unknown-flag"] = ([*cases["one-gpu"][0], "--no-such-flag"], {})
    # The start that crash-looped every SGLang model with adapters: no target modules.
    argv = list(cases["lora-8"][0])
    if "--lora-target-modules" in argv:
        at = argv.index("--lora-target-modules")
        del argv[at : at + 2]
    cases["control-lora-without-target-modules"] = (argv, {})
    judge(verdicts("sglang", cases, tmp_path), cases, {})
