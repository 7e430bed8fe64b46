"""Placement and reconcile cost on large simulated fleets, measured in-process.

Fleets of 100, 1,000, 5,000 and 10,000 nodes with 8 GPUs each (two zones, about 1% of nodes
with an unhealthy GPU and 1% cordoned), and a catalog mixing models of 1, 2, 4 and 8 GPUs per
shard, some of two shards. For each size it places, from an empty table, one replica per node
on average (the planner's `plan`, as one reconcile pass does it) and prints placements per
second. At 10,000 nodes and 20,000 replicas, all serving, it times one full reconcile pass of
the control plane with nothing to change (`ControlPlane.reconcile_once`: the planner and
everything the control plane derives for it from agents' reports), made to plan anyway, and
one that sees nothing new and plans nothing (what an idle pass costs), and the peak memory of the
Python heap while building that state (tracemalloc). It prints the cost ratio per tenfold of
fleet size, then one JSON line with `placements_per_s` (by size), `reconcile_pass_ms_10000`,
`idle_pass_ms_10000` and `peak_mib_10000`.

    python bench/placement.py [--sizes 100,1000,5000,10000]

Targets: >= 10,000 placements/s at 5,000 nodes; a pass at 10,000 nodes within 100 ms; cost
growing no faster than linearly with the fleet.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections import Counter
from typing import Any

import yaml
from kit import end_on_sigterm, json_line, state_dir

from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Gpu, Mark, Node
from modelfleet.core.reconcile import plan
from modelfleet.messages.wire import AgentReport, GpuReport, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

GIB = 2**30
NOW = 1000.0
# (gpus per shard, shards, share of the replicas), the largest first: the planner places in
# catalog order, and the large ones first leave fewer whole nodes cut up by small ones.
MIX = ((8, 1, 0.05), (4, 2, 0.05), (4, 1, 0.10), (2, 1, 0.25), (1, 1, 0.55))


def catalog_for(replicas: int) -> list[dict[str, Any]]:
    """Models in the mix, with replica counts summing to about `replicas`."""
    models = []
    for i, (gpus, shards, share) in enumerate(MIX):
        variants: tuple[dict[str, Any], ...] = (
            {},
            {"node_labels": {"zone": "b"}},
            {"placement": "pack"},
        )
        for variant, extra in enumerate(variants):
            models.append(
                {
                    "name": f"m{gpus}x{shards}-{variant}-{i}",
                    "engine": "sim",
                    "gpus_per_shard": gpus,
                    "shards": shards,
                    "gpu_memory": "60GiB",
                    "gpu_model": "H100",
                    "replicas": max(1, round(replicas * share / 3)),
                    **extra,
                }
            )
    return models


def gpu_reports(n: int) -> list[list[GpuReport]]:
    fleet = []
    for i in range(n):
        gpus = [
            GpuReport(index=g, model="NVIDIA H100 80GB HBM3", memory_total=80 * GIB, memory_used=0)
            for g in range(8)
        ]
        if i % 100 == 7:
            gpus[3] = gpus[3].model_copy(update={"healthy": False, "reason": "XID 79"})
        fleet.append(gpus)
    return fleet


def nodes_for(n: int) -> list[Node]:
    nodes = []
    for i, gpus in enumerate(gpu_reports(n)):
        nodes.append(
            Node(
                f"node-{i:05d}",
                tuple(
                    Gpu(g.index, g.model, g.memory_total, g.memory_used, g.healthy, g.reason)
                    for g in gpus
                ),
                labels={"zone": "ab"[i % 2]},
                last_report=NOW,
                mark=Mark.CORDONED if i % 100 == 42 else Mark.NONE,
            )
        )
    return nodes


def time_placements(n: int) -> tuple[int, float]:
    """Place about one replica per node from an empty table; (placed, seconds)."""
    catalog = Catalog.new(catalog_for(n))
    nodes = nodes_for(n)
    gc.collect()
    began = time.perf_counter()
    decided = plan(catalog, [], set(), nodes, set(), NOW, 10.0)
    took = time.perf_counter() - began
    return len(decided.new), took


def full_state(n: int, replicas: int) -> ControlPlane:
    """A control plane that knows `n` nodes and `replicas` serving replicas, as reported."""
    models = catalog_for(replicas)
    store = SqliteStore(":memory:")
    keeper = CatalogKeeper(store)
    keeper.lead(0.0)
    keeper.apply(yaml.safe_dump({"models": models}), "bench", 0.0)
    config = ControlPlaneConfig(
        admin_token="bench-token", settle_for=-1, state_dir=state_dir("placement")
    )
    cp = ControlPlane(config, keeper)
    catalog = keeper.current
    gpus = gpu_reports(n)
    names = [f"node-{i:05d}" for i in range(n)]
    for name, node_gpus in zip(names, gpus, strict=True):
        report = AgentReport(
            node=name,
            boot_id="b",
            seq=1,
            address="10.0.0.1",
            gpus=node_gpus,
            labels={"zone": "ab"[int(name[5:]) % 2]},
            shards=[],
        )
        cp.state.take_report(report, catalog, NOW)
    cp.reconcile_once(NOW)
    seq = 2
    by_node: dict[str, list[ShardReport]] = {name: [] for name in names}
    for node, assigned in cp.assignments.everyone(catalog).items():
        by_node[node] = [
            ShardReport.of(a, ShardState.READY, port=20000 + i) for i, a in enumerate(assigned)
        ]
    for name, node_gpus in zip(names, gpus, strict=True):
        report = AgentReport(
            node=name,
            boot_id="b",
            seq=seq,
            address="10.0.0.1",
            gpus=node_gpus,
            labels={"zone": "ab"[int(name[5:]) % 2]},
            shards=by_node[name],
        )
        cp.state.take_report(report, catalog, NOW)
    # Ask for what was placed, so that nothing is pending and the pass has nothing to do.
    placed = Counter(r.replica.model for r in cp.state.replicas.values())
    for m in models:
        m["replicas"] = placed[m["name"]]
    keeper.apply(yaml.safe_dump({"models": [m for m in models if m["replicas"]]}), "bench", 0.0)
    return cp


def time_pass(cp: ControlPlane, planning: bool, runs: int = 7) -> float:
    """The median time of a pass with nothing to change: one that plans anyway (`planning`), or
    one that sees nothing new to plan from and plans nothing."""
    before = len(cp.state.replicas)
    times = []
    for _ in range(runs):
        gc.collect()
        if planning:
            cp.replan()
        plans = cp.plans
        began = time.perf_counter()
        cp.reconcile_once(NOW + 1)
        times.append(time.perf_counter() - began)
        assert cp.plans == plans + planning, "the pass did not do what it was timed for"
    assert len(cp.state.replicas) == before, "the pass changed something"
    return statistics.median(times)


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,5000,10000")
    parser.add_argument("--pass-nodes", type=int, default=10000)
    parser.add_argument("--pass-replicas", type=int, default=20000)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    rates: dict[str, float] = {}
    per_placement: dict[int, float] = {}
    print("placements from an empty table, one replica per node on average:")
    for n in sizes:
        placed, took = time_placements(n)
        rates[str(n)] = placed / took
        per_placement[n] = took / placed
        print(
            f"  {n:>6} nodes: {placed:>6} placed in {took * 1000:8.1f} ms = "
            f"{placed / took:>9,.0f} placements/s"
        )
    for small in sizes:
        big = small * 10
        if big in per_placement:
            ratio = per_placement[big] / per_placement[small]
            print(
                f"  cost of one placement, {big} vs {small} nodes: x{ratio:.2f} "
                "(1.0 = flat; 10 would be linear in the fleet)"
            )
    n, r = args.pass_nodes, args.pass_replicas
    cp = full_state(n, r)
    held = len(cp.state.replicas)
    cp.reconcile_once(NOW + 1)  # what the first pass placed is planned from once more
    pass_s = time_pass(cp, planning=True)
    idle_s = time_pass(cp, planning=False)
    print(
        f"reconcile pass, {n} nodes, {held} replicas serving, nothing to change: "
        f"{pass_s * 1000:.1f} ms planning anyway, {idle_s * 1000:.3f} ms seeing nothing new"
    )
    small_cp = full_state(n // 10, r // 10)
    small_cp.reconcile_once(NOW + 1)
    small_pass = time_pass(small_cp, planning=True)
    print(
        f"  vs {n // 10} nodes, {len(small_cp.state.replicas)} replicas: {small_pass * 1000:.1f} ms"
        f" planning (x{pass_s / small_pass:.1f} for ten times the fleet)"
    )
    del cp, small_cp
    gc.collect()

    tracemalloc.start()
    cp = full_state(n, r)
    cp.reconcile_once(NOW + 1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"peak Python heap building that state and running a pass: {peak / 2**20:.0f} MiB")

    json_line(
        {
            "bench": "placement",
            "placements_per_s": {k: round(v) for k, v in rates.items()},
            "reconcile_pass_ms_10000": round(pass_s * 1000, 2),
            "idle_pass_ms_10000": round(idle_s * 1000, 3),
            "replicas_10000": held,
            "peak_mib_10000": round(peak / 2**20, 1),
        }
    )


if __name__ == "__main__":
    main()
