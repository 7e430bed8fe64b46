"""The fleet as the control plane sees it: nodes, their GPUs, and the replicas placed on them.

Plain immutable data, no I/O. The control plane builds these from agents' reports and its own
table of replicas, and hands them to `placement` and `reconcile`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType


class Mark(StrEnum):
    """An operator's mark on a node."""

    NONE = "none"
    CORDONED = "cordoned"  # nothing new lands here
    DRAINING = "draining"  # replicas move away, make-before-break
    # Its credential was revoked: nothing it sends is taken, and its replicas are replaced
    # elsewhere as a lost node's are. It comes back only by joining anew.
    REVOKED = "revoked"


@dataclass(frozen=True)
class Gpu:
    """One GPU of a node, as its agent last reported it."""

    index: int
    model: str
    memory_total: int
    memory_used: int = 0
    healthy: bool = True
    reason: str = ""  # why it is unhealthy ("XID 79", "NVML: GPU is lost"); empty when healthy

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)


@dataclass(frozen=True)
class Node:
    """A machine with an agent."""

    name: str
    gpus: tuple[Gpu, ...]
    address: str = "127.0.0.1"  # where its engines can be reached
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    last_report: float | None = None  # clock of the control plane when the last report arrived
    mark: Mark = Mark.NONE
    # While draining: when the grace period ends and what still runs here is stopped anyway
    # (the control plane's clock); None waits for replacements without a bound.
    drain_deadline: float | None = None

    def is_ready(self, now: float, stale_after: float) -> bool:
        """Whether the node reported within `stale_after` seconds of `now`."""
        return self.last_report is not None and now - self.last_report <= stale_after


@dataclass(frozen=True)
class ShardPlacement:
    """Where one shard of a replica runs: a node and the GPUs it uses there."""

    node: str
    gpus: tuple[int, ...]


# A replica's id: its model's name made safe (`replica_id_stem`), "-", and this many hex
# digits drawn at random.
REPLICA_ID_DIGITS = 6


def replica_id_stem(model: str) -> str:
    """What the id of every replica of `model` begins with, before its "-" and digits."""
    return re.sub(r"[^A-Za-z0-9.-]+", "-", model).strip("-")[:40] or "replica"


@dataclass(frozen=True)
class Replica:
    """One serving instance of a model, as the control plane has placed it."""

    id: str
    model: str
    engine_digest: str  # the ModelSpec.engine_digest it was started from
    shards: tuple[ShardPlacement, ...]
    created: float

    def gpu_slots(self) -> set[tuple[str, int]]:
        """Every (node, GPU index) this replica uses."""
        return {(s.node, g) for s in self.shards for g in s.gpus}


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`name` to sort as people read it: the digits in it as numbers (node-2 before node-10),
    the rest as text."""
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts if p)
