"""GPU health from NVML, through a fake pynvml: every fault the agent must see, and a node
whose lost GPU is shown with its reason and never placed on."""

from __future__ import annotations

import time

import yaml

from modelfleet.agent.gpus import NvmlGpus
from modelfleet.controlplane import views
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages.wire import AgentReport
from modelfleet.store.sqlite import SqliteStore

from .fake_nvml import FakeGpu, FakeNvml


def test_a_healthy_gpu_reports_its_name_memory_and_utilisation() -> None:
    fake = FakeNvml([FakeGpu(used=10 * 2**30, utilization=37), FakeGpu(utilization=None)])
    gpu, other = NvmlGpus(fake.module()).gpus()
    assert fake.initialised
    assert (gpu.model, gpu.memory_total, gpu.memory_used, gpu.utilization) == (
        "NVIDIA H100 80GB HBM3",
        80 * 2**30,
        10 * 2**30,
        37.0,
    )
    assert gpu.healthy and gpu.reason == ""
    assert other.utilization is None and other.healthy  # not supported: not said, not a fault


def test_every_fault_marks_its_gpu_unhealthy_with_the_reason() -> None:
    fake = FakeNvml([FakeGpu() for _ in range(7)])
    fake.gpus[0].lost = True
    fake.gpus[1].remapped_rows = (0, 1, 0, 1)
    fake.gpus[2].remapped_rows = (0, 0, 1, 0)
    fake.gpus[3].retired_pending = True
    fake.gpus[4].ecc_uncorrected = 2
    fake.gpus[5].remapped_rows = None  # not supported on this GPU: no verdict from it
    source = NvmlGpus(fake.module())
    fake.events += [(6, 79), (5, 13)]  # 13 is an application's fault, not the GPU's
    reasons = {g.index: (g.healthy, g.reason) for g in source.gpus()}
    assert reasons == {
        0: (False, "NVML: GPU is lost"),
        1: (False, "row remapping failed"),
        2: (False, "row remapping pending: reset the GPU"),
        3: (False, "retired pages pending: reset the GPU"),
        4: (False, "2 uncorrectable ECC error(s)"),
        5: (True, ""),
        6: (False, "XID 79"),
    }
    assert source.gpus()[6].reason == "XID 79"  # an XID stays until the agent restarts


def test_a_lost_gpu_is_shown_with_its_reason_and_nothing_lands_on_it() -> None:
    fake = FakeNvml([FakeGpu() for _ in range(2)])
    fake.gpus[1].lost = True
    source = NvmlGpus(fake.module())
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    models = [{"name": "m", "engine": "sim", "replicas": 2}]
    keeper.apply(yaml.safe_dump({"models": models}), "api", 0.0)
    cp = ControlPlane(ControlPlaneConfig(admin_token="t" * 8, settle_for=-1), keeper)
    report = AgentReport(
        node="gpu-1", boot_id="b", seq=1, address="10.0.0.1", gpus=source.gpus(), shards=[]
    )
    now = time.monotonic()
    cp.state.take_report(report, keeper.current, now)
    cp.reconcile_once(now)

    [node] = views.nodes(cp.state, now).nodes
    lost = node.gpus[1]
    assert (lost.healthy, lost.reason, lost.in_use) == (False, "NVML: GPU is lost", False)
    placed = [s.gpus for s in cp.assignments.of("gpu-1", keeper.current).shards]
    assert placed == [[0]]  # one replica on GPU 0; the second is pending, not on GPU 1
    [pending] = cp.state.pending
    assert "gpu 1 unhealthy: NVML: GPU is lost" in " ".join(
        r for v in pending.explanation.verdicts for r in v.reasons
    )
