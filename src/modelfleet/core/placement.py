"""Placement: a pure function from what a replica needs and the nodes to a choice of GPUs.

When no choice exists the answer is an explanation instead: every node considered and, for
each, every reason it was rejected, with figures. That is what `ctl explain-placement` prints.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from modelfleet.core.catalog import ModelSpec
from modelfleet.core.fleet import Gpu, Mark, Node, ShardPlacement
from modelfleet.core.units import format_size


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


def gpu_fits(spec: ModelSpec, gpu: Gpu) -> bool:
    """Whether a healthy, free GPU is of the model and has the memory `spec` asks for."""
    if spec.gpu_model and spec.gpu_model.lower() not in gpu.model.lower():
        return False
    return gpu.memory_free >= spec.gpu_memory


def labels_fit(spec: ModelSpec, node: Node) -> bool:
    return all(node.labels.get(k) == v for k, v in spec.node_labels.items())


def judge_node(
    spec: ModelSpec,
    node: Node,
    used: Collection[tuple[str, int]],
    now: float,
    stale_after: float,
    avoided: str = "",
) -> NodeVerdict:
    """Whether one shard of `spec` fits on `node`, and if not, every reason why.

    `avoided` says why the model is kept off this node for now (a replica of it kept failing
    here), or is empty.
    """
    reasons: list[str] = []
    if avoided:
        reasons.append(f"avoided: a replica of {spec.name} failed here ({avoided})")
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
        elif gpu_fits(spec, gpu):
            usable.append(gpu.index)
        elif spec.gpu_model and spec.gpu_model.lower() not in gpu.model.lower():
            excluded.append(f"gpu {gpu.index} is {gpu.model}, not {spec.gpu_model}")
        else:
            excluded.append(f"gpu {gpu.index} has {format_size(gpu.memory_free)} free")
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
    avoid: Mapping[str, str] = MappingProxyType({}),
) -> Placed | Unplaceable:
    """Choose GPUs for one new replica of `spec`, or explain why none can be chosen.

    `used` holds every (node, GPU index) already taken; `replicas_on_node` counts the
    replicas of this model per node, which `spread` uses to keep them apart; `avoid` maps the
    nodes this model is kept off to why. Each shard goes to a different node, using
    `gpus_per_shard` GPUs of it. The answer depends only on the arguments: the same input
    always gives the same placement.
    """
    verdicts = [judge_node(spec, n, used, now, stale_after, avoid.get(n.name, "")) for n in nodes]
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


_GpuKey = tuple[str | None, int]  # (gpu model asked for, lower-cased; memory asked for)
_HeapKey = tuple[str, _GpuKey, tuple[tuple[str, str], ...], int, str]


# Why a replica goes where it does, as FreeGpus.claim chooses, in words for operators.
RULES = {
    "spread": "the node with the fewest of its replicas, then the most free GPUs",
    "pack": "the node with the fewest free GPUs that fit",
}


@dataclass
class FreeGpus:
    """The fleet's free GPUs during one planning pass, indexed so a placement does not judge
    every node.

    `claim` answers as `place` would for the same state (the same nodes qualify, in the same
    policy order, with the same ties broken by node name) and records the GPUs it hands out,
    so the next claim sees them taken. Where `place` judges every node per replica, `claim`
    keeps, per kind of request, a heap of the nodes that can host a shard, ordered by the
    policy; a heap entry that a later claim made stale is dropped when it comes up. What is
    built for one kind of request is built once per pass, and only when such a replica is
    placed, so a pass with nothing to place builds nothing.
    """

    nodes: Mapping[str, Node]  # ready, unmarked nodes only
    used: set[tuple[str, int]]
    _usable: dict[_GpuKey, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    _heaps: dict[_HeapKey, list[tuple[int | str, ...]]] = field(default_factory=dict)
    _specs: dict[_HeapKey, ModelSpec] = field(default_factory=dict)
    _counts: dict[str, dict[str, int]] = field(default_factory=dict)  # spread: model -> node -> n

    @classmethod
    def of(
        cls, nodes: Sequence[Node], used: Collection[tuple[str, int]], now: float, stale: float
    ) -> FreeGpus:
        eligible = {n.name: n for n in nodes if n.mark is Mark.NONE and n.is_ready(now, stale)}
        return cls(eligible, set(used))

    def claim(
        self,
        spec: ModelSpec,
        replicas_on_node: Mapping[str, int],
        avoid: Collection[str] = frozenset(),
    ) -> tuple[ShardPlacement, ...] | None:
        """Choose and take GPUs for one replica of `spec`; None when no placement exists.

        `replicas_on_node` counts the model's replicas per node before this pass; the index
        counts what it places itself from then on. Nodes in `avoid` are passed over.
        """
        key = self._heap_key(spec)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._build(key, spec, replicas_on_node)
        chosen: list[str] = []
        valid: list[tuple[int | str, ...]] = []
        while heap and len(chosen) < spec.shards:
            entry = heapq.heappop(heap)
            name = str(entry[-1])
            if name in chosen or entry != self._entry(key, name):
                continue  # stale: a fresher entry for this node was pushed when it changed
            valid.append(entry)
            if name not in avoid:
                chosen.append(name)
        if len(chosen) < spec.shards:
            for entry in valid:
                heapq.heappush(heap, entry)
            return None
        for entry in valid:  # the avoided ones, still good for other claims
            if entry[-1] not in chosen:
                heapq.heappush(heap, entry)
        usable = self._usable[key[1]]
        shards = tuple(ShardPlacement(n, usable[n][: spec.gpus_per_shard]) for n in chosen)
        self._take(spec, shards)
        return shards

    def _heap_key(self, spec: ModelSpec) -> _HeapKey:
        labels = tuple(sorted(spec.node_labels.items()))
        model = spec.name if spec.placement == "spread" else ""
        gpu_key = (spec.gpu_model.lower() if spec.gpu_model else None, spec.gpu_memory)
        return (spec.placement, gpu_key, labels, spec.gpus_per_shard, model)

    def _build(
        self, key: _HeapKey, spec: ModelSpec, replicas_on_node: Mapping[str, int]
    ) -> list[tuple[int | str, ...]]:
        if key[1] not in self._usable:
            self._usable[key[1]] = {
                name: tuple(
                    g.index
                    for g in node.gpus
                    if g.healthy and (name, g.index) not in self.used and gpu_fits(spec, g)
                )
                for name, node in self.nodes.items()
            }
        self._specs[key] = spec
        if spec.placement == "spread" and spec.name not in self._counts:
            self._counts[spec.name] = {n: c for n, c in replicas_on_node.items() if c}
        heap = [e for name in self.nodes if (e := self._entry(key, name)) is not None]
        heapq.heapify(heap)
        self._heaps[key] = heap
        return heap

    def _entry(self, key: _HeapKey, name: str) -> tuple[int | str, ...] | None:
        """The node's place in the heap now, or None when it cannot host a shard."""
        usable = self._usable[key[1]][name]
        if len(usable) < key[3]:
            return None
        if key[2] and not labels_fit(self._specs[key], self.nodes[name]):
            return None
        if key[0] == "pack":
            return (len(usable), name)
        return (self._counts[key[4]].get(name, 0), -len(usable), name)

    def _take(self, spec: ModelSpec, shards: tuple[ShardPlacement, ...]) -> None:
        if spec.placement == "spread":
            counts = self._counts[spec.name]
            for s in shards:
                counts[s.node] = counts.get(s.node, 0) + 1
        for s in shards:
            self.used.update((s.node, g) for g in s.gpus)
            for usable in self._usable.values():
                usable[s.node] = tuple(g for g in usable[s.node] if (s.node, g) not in self.used)
            # Every heap gets the node's fresh entry; the entries it had are stale from now on.
            for key, heap in self._heaps.items():
                entry = self._entry(key, s.node)
                if entry is not None:
                    heapq.heappush(heap, entry)
