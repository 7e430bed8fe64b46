"""What `up` runs: the default catalog, the shape of the fleet, and each process's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NODES = ("node-1", "node-2")
GPUS_PER_NODE = "4x80GB"
REAL_GPUS = "nvml"  # the machine's own GPUs, read through NVML, on one node
# Then CORES[xMEMORY]: the machine's cores in slots (agent --cpu-slots), on one node.
CPU_SLOTS = "cpu:"

DEFAULT_CATALOG = """\
# The catalog `modelfleet up` serves. Edit it while the fleet runs: a valid change applies
# within a second, with no restart (an invalid one is refused; `modelfleet ctl catalog show`).
models:
  - name: sim-chat
    engine: sim
    replicas: 2
    gpus_per_shard: 1
    gpu_memory: 20GiB
    args: ["--ttft", "0.05", "--itl", "0.01"]
  - name: sim-large
    engine: sim
    replicas: 1
    gpus_per_shard: 2
    gpu_memory: 60GiB
    args: ["--ttft", "0.2", "--itl", "0.02"]
"""


@dataclass(frozen=True)
class FleetOptions:
    """The shape of a fleet `up` starts. The defaults are what `modelfleet up` runs."""

    nodes: tuple[str, ...] = NODES
    gpus: str = GPUS_PER_NODE  # every node's simulated GPUs, REAL_GPUS, or CPU_SLOTS...
    router_port: int = 0
    report_interval: float = 1.0
    reconcile_interval: float = 0.5
    stop_grace: float = 10.0
    control_plane: dict[str, Any] = field(default_factory=dict)  # more control-plane settings
    router: dict[str, Any] = field(default_factory=dict)  # more router settings
    agent_args: tuple[str, ...] = ()  # more agent flags
    extra_routers: tuple[str, ...] = ()  # push URLs of routers beyond the one it starts
    # Where the router counts keys' limits, kept across `up`s: a Redis URL ("" for its own
    # memory), or `redis` True to run Debian's redis-server in the state dir. None: as before.
    limits_store: str | None = None
    redis: bool | None = None
    # Control planes on one store (the first leads at start; the others follow and take over
    # when it stops), and the store: "sqlite", "postgres" (one `up` runs in the state dir) or
    # a PostgreSQL URL; None: as before (SQLite the first time). Several need PostgreSQL.
    control_planes: int = 1
    store: str | None = None


def agent_gpu_flags(gpus: str) -> list[str]:
    """The agent flags for `FleetOptions.gpus`."""
    if gpus == REAL_GPUS:
        return []
    if gpus.startswith(CPU_SLOTS):
        return ["--cpu-slots", gpus.removeprefix(CPU_SLOTS)]
    return ["--simulate-gpus", gpus]


def one_machine(gpus: str) -> bool:
    """Whether `gpus` are this machine's own (then the fleet is one node)."""
    return gpus == REAL_GPUS or gpus.startswith(CPU_SLOTS)
