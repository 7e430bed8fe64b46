"""A node without GPUs offers its cores as slots (`agent --cpu-slots`): each engine runs on its
own slot's cores, and a shard given a slot the node lacks fails saying so."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from modelfleet.agent.gpus import CpuSlots
from modelfleet.agent.service import Agent
from modelfleet.messages.wire import NodeAssignment, ShardAssignment, ShardState
from modelfleet.up.configs import agent_gpu_flags

from .conftest import Operator, fleet_of, until, wait_for
from .test_processes import offline_agent


def sim_shard(replica_id: str, slot: int) -> ShardAssignment:
    return ShardAssignment(
        replica_id=replica_id, model="m", engine="sim", source="m", args=[], env={}, rank=0,
        num_shards=1, gpus=[slot], engine_digest="d", startup_timeout=60,
    )  # fmt: skip


def test_each_engine_runs_on_its_own_slot_s_cores(tmp_path: Path) -> None:
    slots = CpuSlots("1")  # a slot per core this test may run on
    two = [0, len(slots.slots) - 1]  # on a machine of one core, both are core 0's slot

    async def go() -> None:
        settings = offline_agent(tmp_path, stop_grace=5.0, cpu_slots=slots.slots)
        async with Agent(settings, slots) as agent:
            shards = [sim_shard(f"r{slot}", slot) for slot in two]
            agent.apply(NodeAssignment(node="n", shards=[*shards, sim_shard("nowhere", 99)]))
            running = [agent.shards[s.key] for s in shards]
            try:
                await until(
                    "both engines ready", lambda: all(s.state is ShardState.READY for s in running)
                )
                for shard, slot in zip(running, two, strict=True):
                    assert shard.proc is not None
                    engine = psutil.Process(shard.proc.pid)
                    assert engine.cpu_affinity() == list(slots.slots[slot]), engine.cmdline()
                nowhere = agent.shards["nowhere/0"]
                await until("the shard without a slot failed", lambda: nowhere.error)
                assert nowhere.state is ShardState.FAILED
                assert "no CPU slot [99] on this node" in str(nowhere.error)
            finally:  # engines outlive their agent: this test ends those it started
                agent.apply(NodeAssignment(node="n", shards=[]))
                await until("the engines stopped", lambda: not agent.stopping)

    asyncio.run(go())


def test_up_on_a_machine_s_cores_places_a_cpu_model_on_its_slots(tmp_path: Path) -> None:
    model = {"name": "on-cpu", "engine": "sim", "gpu_model": "CPU", "replicas": 2}
    with fleet_of(tmp_path, [model], gpus="cpu:1", nodes=("node-1",)) as fleet:
        op = Operator(fleet, tmp_path)
        [node] = op.get("/v1/nodes")["nodes"]
        assert {g["model"] for g in node["gpus"]} == {"CPU"}
        wait_for("on-cpu served", lambda: op.serves("on-cpu"))
        placed = [s["gpus"] for r in op.replicas("on-cpu") for s in r["shards"]]
        if len(node["gpus"]) >= 2:  # a slot each: never one core for both
            assert sorted(placed) == [[0], [1]]


@pytest.mark.parametrize(
    ("gpus", "flags"),
    [("cpu:4", ["--cpu-slots", "4"]), ("nvml", []), ("2x80GB", ["--simulate-gpus", "2x80GB"])],
)
def test_up_tells_its_agents_where_their_gpus_come_from(gpus: str, flags: list[str]) -> None:
    assert agent_gpu_flags(gpus) == flags
