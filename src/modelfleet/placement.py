"""Placement: a pure function from what a replica needs and the nodes to a choice of GPUs.

When no choice exists the answer is an explanation instead: every node considered and, for
each, every reason it was rejected, with figures. That is what `ctl explain-placement` prints.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from modelfleet.catalog import ModelSpec
from modelfleet.fleet import Mark, Node, ShardPlacement
from modelfleet.units import format_size


@dataclass(frozen=True)
class NodeVerdict:
    """What placement made of one node: the GPUs a shard could use there, or why none."""

    node: str
    usable_gpus: tuple[int, ...]
    reasons: tuple[str, ...]  # empty when the node can host a shard

    @property
    def fits(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Placed:
    """A placement was found: one node and its GPUs per shard, in rank order.

    `verdicts` says what placement made of every node, as for an `Unplaceable`.
    """

    shards: tuple[ShardPlacement, ...]
    verdicts: tuple[NodeVerdict, ...] = ()


@dataclass(frozen=True)
class Unplaceable:
    """No placement exists now. `verdicts` covers every node considered."""

    model: str
    summary: str
    verdicts: tuple[NodeVerdict, ...]


def describe_need(spec: ModelSpec) -> str:
    """A one-line statement of what each shard of `spec` needs."""
    need = f"{spec.gpus_per_shard} GPU(s)"
    if spec.gpu_memory:
        need += f" with >= {format_size(spec.gpu_memory)} free"
    if spec.gpu_model:
        need += f" of model {spec.gpu_model}"
    if spec.node_labels:
        need += " on a node labelled " + ",".join(f"{k}={v}" for k, v in spec.node_labels.items())
    return need


def judge_node(
    spec: ModelSpec,
    node: Node,
    used: Collection[tuple[str, int]],
    now: float,
    stale_after: float,
) -> NodeVerdict:
    """Whether one shard of `spec` fits on `node`, and if not, every reason why."""
    reasons: list[str] = []
    if not node.is_ready(now, stale_after):
        if node.last_report is None:
            reasons.append("node not ready: it has never reported")
        else:
            reasons.append(f"node not ready: last report {now - node.last_report:.0f}s ago")
    if node.mark is not Mark.NONE:
        reasons.append(f"node {node.mark.value}")
    for key, want in spec.node_labels.items():
        have = node.labels.get(key)
        if have != want:
            has = f"has {key}={have}" if have is not None else f"no label {key}"
            reasons.append(f"needs label {key}={want}, {has}")

    usable: list[int] = []
    excluded: list[str] = []
    for gpu in node.gpus:
        if not gpu.healthy:
            excluded.append(f"gpu {gpu.index} unhealthy: {gpu.reason or 'no reason given'}")
        elif (node.name, gpu.index) in used:
            excluded.append(f"gpu {gpu.index} in use")
        elif spec.gpu_model and spec.gpu_model.lower() not in gpu.model.lower():
            excluded.append(f"gpu {gpu.index} is {gpu.model}, not {spec.gpu_model}")
        elif gpu.memory_free < spec.gpu_memory:
            excluded.append(f"gpu {gpu.index} has {format_size(gpu.memory_free)} free")
        else:
            usable.append(gpu.index)
    if len(usable) < spec.gpus_per_shard:
        detail = f" ({'; '.join(excluded)})" if excluded else ""
        reasons.append(f"needs {describe_need(spec)}, has {len(usable)}{detail}")
    return NodeVerdict(node.name, tuple(usable), tuple(reasons))


def place(
    spec: ModelSpec,
    nodes: Sequence[Node],
    used: Collection[tuple[str, int]],
    replicas_on_node: Mapping[str, int],
    now: float,
    stale_after: float,
) -> Placed | Unplaceable:
    """Choose GPUs for one new replica of `spec`, or explain why none can be chosen.

    `used` holds every (node, GPU index) already taken; `replicas_on_node` counts the
    replicas of this model per node, which `spread` uses to keep them apart. Each shard goes
    to a different node, using `gpus_per_shard` GPUs of it. The answer depends only on the
    arguments: the same input always gives the same placement.
    """
    verdicts = [judge_node(spec, n, used, now, stale_after) for n in nodes]
    fitting = [v for v in verdicts if v.fits]
    if len(fitting) < spec.shards:
        if not nodes:
            summary = "no nodes have reported"
        elif spec.shards == 1:
            summary = f"no node can host a shard: needs {describe_need(spec)}"
        else:
            summary = (
                f"needs {spec.shards} nodes for {spec.shards} shards of {describe_need(spec)}, "
                f"{len(fitting)} can host one"
            )
        return Unplaceable(spec.name, summary, tuple(sorted(verdicts, key=lambda v: v.node)))

    if spec.placement == "pack":

        def order(v: NodeVerdict) -> tuple[int, int, str]:
            return (len(v.usable_gpus), 0, v.node)
    else:

        def order(v: NodeVerdict) -> tuple[int, int, str]:
            return (replicas_on_node.get(v.node, 0), -len(v.usable_gpus), v.node)

    chosen = sorted(fitting, key=order)[: spec.shards]
    return Placed(
        tuple(ShardPlacement(v.node, v.usable_gpus[: spec.gpus_per_shard]) for v in chosen),
        tuple(sorted(verdicts, key=lambda v: v.node)),
    )
