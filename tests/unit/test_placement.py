"""Placement: properties over random small fleets, and the explanation of a rejection."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from modelfleet.core.catalog import Catalog, ModelSpec
from modelfleet.core.fleet import Gpu, Mark, Node, ShardPlacement
from modelfleet.core.placement import FreeGpus, Placed, Unplaceable, judge_node, place

NOW = 1000.0
STALE = 10.0
GIB = 2**30


def spec(**kw: object) -> ModelSpec:
    return Catalog.new([{"name": "m", "engine": "sim", **kw}]).models[0]


gpus = st.builds(
    Gpu,
    index=st.just(0),
    model=st.sampled_from(["H100", "A100"]),
    memory_total=st.sampled_from([40 * GIB, 80 * GIB]),
    memory_used=st.sampled_from([0, 30 * GIB]),
    healthy=st.booleans(),
    reason=st.just("XID 79"),
)


@st.composite
def fleets(
    draw: st.DrawFn, max_nodes: int = 4, mostly_eligible: bool = False
) -> tuple[list[Node], set[tuple[str, int]]]:
    """Small fleets; `mostly_eligible` makes most nodes ready and unmarked, so that placements
    have several candidates to choose among."""
    reports = [None, NOW - 1, NOW - 100]
    marks = list(Mark)
    if mostly_eligible:
        reports, marks = [NOW - 1] * 4 + reports, [Mark.NONE] * 4 + marks
    nodes = []
    for i in range(draw(st.integers(0, max_nodes))):
        raw = draw(st.lists(gpus, min_size=0, max_size=4))
        node_gpus = tuple(
            Gpu(
                j,
                g.model,
                g.memory_total,
                g.memory_used,
                g.healthy,
                g.reason if not g.healthy else "",
            )
            for j, g in enumerate(raw)
        )
        nodes.append(
            Node(
                f"n{i}",
                node_gpus,
                last_report=draw(st.sampled_from(reports)),
                mark=draw(st.sampled_from(marks)),
                labels={"zone": draw(st.sampled_from(["a", "b"]))},
            )
        )
    slots = [(n.name, g.index) for n in nodes for g in n.gpus]
    used = set(draw(st.lists(st.sampled_from(slots), unique=True))) if slots else set()
    return nodes, used


specs = st.builds(
    spec,
    shards=st.integers(1, 3),
    gpus_per_shard=st.integers(1, 3),
    gpu_memory=st.sampled_from(["0", "40GiB", "60GiB"]),
    gpu_model=st.sampled_from([None, "H100"]),
    node_labels=st.sampled_from([{}, {"zone": "a"}]),
    placement=st.sampled_from(["spread", "pack"]),
)


def usable(s: ModelSpec, node: Node, used: set[tuple[str, int]]) -> list[int]:
    """Brute-force restatement of the rules, independent of judge_node's code."""
    if node.last_report is None or NOW - node.last_report > STALE or node.mark is not Mark.NONE:
        return []
    if any(node.labels.get(k) != v for k, v in s.node_labels.items()):
        return []
    return [
        g.index
        for g in node.gpus
        if g.healthy
        and (node.name, g.index) not in used
        and (s.gpu_model is None or s.gpu_model in g.model)
        and g.memory_total - g.memory_used >= s.gpu_memory
    ]


@settings(max_examples=300, deadline=None)
@given(fleets(), specs)
def test_placement_properties(fleet: tuple[list[Node], set[tuple[str, int]]], s: ModelSpec) -> None:
    nodes, used = fleet
    answer = place(s, nodes, used, {}, NOW, STALE)
    assert answer == place(s, nodes, used, {}, NOW, STALE)  # deterministic
    by_name = {n.name: n for n in nodes}
    # Brute force: is there any choice of `shards` distinct nodes each with enough usable GPUs?
    exists = any(
        all(len(usable(s, by_name[n], used)) >= s.gpus_per_shard for n in combo)
        for combo in itertools.combinations(by_name, s.shards)
    )
    if isinstance(answer, Placed):
        assert len(answer.shards) == s.shards
        assert len({sh.node for sh in answer.shards}) == s.shards
        slots = [(sh.node, g) for sh in answer.shards for g in sh.gpus]
        assert len(slots) == len(set(slots))  # never two shards on one GPU
        for sh in answer.shards:
            assert len(sh.gpus) == s.gpus_per_shard
            assert set(sh.gpus) <= set(usable(s, by_name[sh.node], used))  # never excluded
    else:
        assert not exists, "a placement exists but none was found"
        assert {v.node for v in answer.verdicts} == set(by_name)  # every node explained
        for v in answer.verdicts:
            if not v.fits:
                assert v.reasons
    assert isinstance(answer, Placed) == exists


def test_explanation_names_each_reason_with_figures() -> None:
    node = Node(
        "gpu-7",
        (
            Gpu(0, "H100", 80 * GIB, 0),
            Gpu(1, "H100", 80 * GIB, 70 * GIB),
            Gpu(2, "H100", 80 * GIB, 0, healthy=False, reason="XID 79"),
        ),
        last_report=NOW,
        mark=Mark.CORDONED,
    )
    verdict = judge_node(spec(gpus_per_shard=2, gpu_memory="70GiB"), node, set(), NOW, STALE)
    text = "; ".join(verdict.reasons)
    assert "node cordoned" in text
    assert "gpu 2 unhealthy: XID 79" in text
    assert "needs 2 GPU(s) with >= 70.0 GiB free, has 1" in text
    assert "gpu 1 has 10.0 GiB free" in text


def test_spread_keeps_replicas_apart_and_pack_fills_a_node() -> None:
    nodes = [
        Node(f"n{i}", tuple(Gpu(j, "H100", 80 * GIB) for j in range(4)), last_report=NOW)
        for i in range(2)
    ]
    spread = place(spec(), nodes, {("n0", 0)}, {"n0": 1}, NOW, STALE)
    assert isinstance(spread, Placed) and spread.shards[0].node == "n1"
    packed = place(spec(placement="pack"), nodes, {("n0", 0)}, {"n0": 1}, NOW, STALE)
    assert isinstance(packed, Placed) and packed.shards[0].node == "n0"


def test_no_nodes_is_explained() -> None:
    answer = place(spec(), [], set(), {}, NOW, STALE)
    assert isinstance(answer, Unplaceable) and "no nodes" in answer.summary


@settings(max_examples=300, deadline=None)
@given(
    fleets(max_nodes=6, mostly_eligible=True),
    st.lists(specs, min_size=1, max_size=6),
    st.sets(st.sampled_from(["n0", "n1", "n2"])),
)
def test_the_index_places_as_place_does_claim_after_claim(
    fleet: tuple[list[Node], set[tuple[str, int]]], asked: list[ModelSpec], avoid: set[str]
) -> None:
    """FreeGpus answers each claim exactly as place() would on the state the claims before it
    left: the same nodes, the same GPUs, the same order, and None where place() explains."""
    nodes, used = fleet
    index = FreeGpus.of(nodes, used, NOW, STALE)
    taken = set(used)
    on_node: dict[str, dict[str, int]] = {}
    # One name per distinct spec, as in a catalog; an equal spec again is another replica.
    names: list[ModelSpec] = []
    for raw in asked:
        if raw not in names:
            names.append(raw)
        s = dataclasses.replace(raw, name=f"m{names.index(raw)}")
        counts = on_node.setdefault(s.name, {})
        # The first spec keeps off the `avoid` nodes, as a model that failed there would.
        kept_off = {n: "failed" for n in avoid} if s.name == "m0" else {}
        expected = place(s, nodes, taken, counts, NOW, STALE, kept_off)
        got = index.claim(s, {}, kept_off)
        if isinstance(expected, Unplaceable):
            assert got is None
            continue
        assert got == expected.shards
        for shard in got:
            taken.update((shard.node, g) for g in shard.gpus)
            counts[shard.node] = counts.get(shard.node, 0) + 1
    assert index.used == taken


def test_the_index_sees_what_other_kinds_of_claim_took() -> None:
    """Claims of different kinds interleaved: each heap learns what the others took."""
    nodes = [
        Node(f"n{i}", tuple(Gpu(j, "H100", 80 * GIB) for j in range(4)), last_report=NOW)
        for i in range(2)
    ]
    one = dataclasses.replace(spec(), name="one")
    wide = dataclasses.replace(spec(gpus_per_shard=3, placement="pack"), name="wide")
    index = FreeGpus.of(nodes, set(), NOW, STALE)
    assert index.claim(one, {}) == (ShardPlacement("n0", (0,)),)
    assert index.claim(one, {}) == (ShardPlacement("n1", (0,)),)  # spread
    assert index.claim(wide, {}) == (ShardPlacement("n0", (1, 2, 3)),)
    # n0 is full now, though the spread heap still holds its entry from before the wide claim.
    assert index.claim(one, {}) == (ShardPlacement("n1", (1,)),)
    assert index.claim(wide, {}) is None
    assert index.claim(one, {}) == (ShardPlacement("n1", (2,)),)


@given(
    st.lists(st.tuples(st.sampled_from(["node-", "gpu-", "n"]), st.integers(0, 120)), max_size=30)
)
def test_nodes_sort_as_people_read_them(names: list[tuple[str, int]]) -> None:
    """Issue 41: node-10 came before node-2 everywhere nodes were listed."""
    from modelfleet.core.fleet import natural_key

    named = [f"{prefix}{n}" for prefix, n in names]
    ordered = sorted(named, key=natural_key)
    assert ordered == sorted(
        named, key=lambda s: (s.rstrip("0123456789"), int(s[len(s.rstrip("0123456789")) :]))
    )
    assert sorted(["node-10", "node-2", "node-1"], key=natural_key) == [
        "node-1",
        "node-2",
        "node-10",
    ]
