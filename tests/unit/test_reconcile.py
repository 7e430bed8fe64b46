"""The reconcile planner: placing, scaling, tearing down, make-before-break, settling."""

from __future__ import annotations

import dataclasses

from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Gpu, Mark, Node, Replica, ShardPlacement
from modelfleet.core.placement import Placed, Unplaceable
from modelfleet.core.reconcile import Pending, plan, preview, rebalance, settling

NOW = 100.0
GIB = 2**30


def nodes(n: int = 2, gpus: int = 4) -> list[Node]:
    return [
        Node(f"n{i}", tuple(Gpu(j, "SIM", 80 * GIB) for j in range(gpus)), last_report=NOW)
        for i in range(n)
    ]


def catalog(*models: dict[str, object]) -> Catalog:
    return Catalog.new([{"engine": "sim", **m} for m in models])


def replica(
    rid: str, model: str, digest: str, node: str = "n0", gpu: int = 0, created: float = 1.0
) -> Replica:
    return Replica(rid, model, digest, (ShardPlacement(node, (gpu,)),), created)


def test_places_every_missing_replica_on_distinct_gpus() -> None:
    c = catalog({"name": "a", "replicas": 3}, {"name": "b", "gpus_per_shard": 2})
    p = plan(c, [], set(), nodes(), set(), NOW, 10)
    assert sorted(r.model for r in p.new) == ["a", "a", "a", "b"]
    slots = [(s.node, g) for r in p.new for s in r.shards for g in s.gpus]
    assert len(slots) == len(set(slots)) == 5
    assert not p.stop and not p.pending


def test_nothing_to_do_when_desired_is_actual() -> None:
    c = catalog({"name": "a"})
    digest = c.models[0].engine_digest
    p = plan(c, [replica("a-1", "a", digest)], {"a-1"}, nodes(), set(), NOW, 10)
    assert not p.changes and not p.pending


def test_replicas_of_a_removed_model_are_stopped() -> None:
    c = catalog({"name": "a"})
    digest = c.models[0].engine_digest
    table = [replica("a-1", "a", digest), replica("gone-1", "gone", "x", gpu=1)]
    p = plan(c, table, {"a-1", "gone-1"}, nodes(), set(), NOW, 10)
    assert [(s.replica_id, s.reason) for s in p.stop] == [
        ("gone-1", "model removed from the catalog")
    ]
    assert not p.new


def test_scale_down_stops_the_newest_first() -> None:
    c = catalog({"name": "a", "replicas": 1})
    d = c.models[0].engine_digest
    table = [replica("old", "a", d, created=1), replica("new", "a", d, gpu=1, created=2)]
    p = plan(c, table, {"old", "new"}, nodes(), set(), NOW, 10)
    assert [s.replica_id for s in p.stop] == ["new"]


def test_changed_arguments_replace_make_before_break() -> None:
    c = catalog({"name": "a", "replicas": 1, "args": ["--new"]})
    old = replica("old", "a", "old-digest")
    first = plan(c, [old], {"old"}, nodes(), set(), NOW, 10)
    assert len(first.new) == 1 and not first.stop  # the old one serves until the new one does
    new = Replica("new", "a", c.models[0].engine_digest, first.new[0].shards, 2.0)
    starting = plan(c, [old, new], {"old"}, nodes(), set(), NOW, 10)
    assert not starting.changes
    ready = plan(c, [old, new], {"old", "new"}, nodes(), set(), NOW, 10)
    assert [s.replica_id for s in ready.stop] == ["old"] and not ready.new


def test_unplaceable_replicas_are_pending_with_the_explanation() -> None:
    c = catalog({"name": "big", "gpus_per_shard": 8})
    p = plan(c, [], set(), nodes(), set(), NOW, 10)
    assert not p.new and p.pending[0].count == 1
    assert {v.node for v in p.pending[0].explanation.verdicts} == {"n0", "n1"}


def test_gpus_still_held_by_a_stopping_engine_are_not_reused() -> None:
    c = catalog({"name": "a"})
    busy = {(n.name, g.index) for n in nodes(1) for g in n.gpus}
    p = plan(c, [], set(), nodes(1), busy, NOW, 10)
    assert not p.new and p.pending


def test_settling_window() -> None:
    assert settling(NOW, 95, 10, 60, 95, False)
    assert not settling(NOW, 95, 10, 60, 95, True)  # every node waited for reported
    assert not settling(NOW, 80, 10, 60, 80, None)  # no new node for the window: over
    assert settling(NOW, 50, 10, 60, 99, False)  # nodes still come: on, past the window
    assert not settling(NOW, 40, 10, 60, 99, False)  # but not past the bound
    assert not settling(NOW, 99, -1, 60, 99, False)  # negative: off


def test_changed_arguments_replace_one_replica_at_a_time() -> None:
    """Three replicas, new arguments: never fewer than three serve, never more than four exist."""
    c = catalog({"name": "a", "replicas": 3, "args": ["--new"]})
    table = {f"old{i}": replica(f"old{i}", "a", "old-digest", gpu=i) for i in range(3)}
    serving = set(table)
    fleet = nodes(2)
    seen_new = 0
    for step in range(20):
        p = plan(c, list(table.values()), serving, fleet, set(), NOW + step, 10)
        if not p.changes:
            break
        assert len(p.new) <= 1
        for stop in p.stop:
            table.pop(stop.replica_id)
            serving.discard(stop.replica_id)
        for new in p.new:
            seen_new += 1
            rid = f"new{seen_new}"
            table[rid] = Replica(rid, "a", new.engine_digest, new.shards, NOW + step)
        assert len(table) <= 4
        assert len(serving) >= 3  # the new replica has not served yet: nothing old left
        serving = set(table)  # each new replica serves before the next pass
    assert sorted(table) == ["new1", "new2", "new3"]


def test_preview_runs_the_passes_a_change_takes() -> None:
    c = catalog({"name": "a", "replicas": 2, "args": ["--new"]}, {"name": "b"})
    table = [
        replica("old0", "a", "old-digest", gpu=0),
        replica("old1", "a", "old-digest", node="n1", gpu=0),
        replica("gone", "x", "x", gpu=1),
    ]
    p = preview(c, table, nodes(2), set(), NOW, 10)
    steps = [(s.step, s.action, s.replica.model, s.replica.id) for s in p.steps]
    first = {(a, m) for step, a, m, _ in steps if step == 1}
    assert first == {("stop", "x"), ("start", "a"), ("start", "b")}
    assert [x for x in steps if x[1] == "stop" and x[2] == "a"] == [
        (2, "stop", "a", "old0"),
        (3, "stop", "a", "old1"),
    ]
    assert sum(1 for s in steps if s[1] == "start") == 3 and not p.pending
    # The GPUs of a replica stopped in one pass are still held in the next.
    freed_too_early = [
        s
        for s in p.steps
        if s.action == "start" and s.step == 2 and s.replica.gpu_slots() & {("n0", 1)}
    ]
    assert freed_too_early == []


def test_preview_shows_what_stays_pending() -> None:
    c = catalog({"name": "huge", "gpus_per_shard": 8})
    p = preview(c, [], nodes(2), set(), NOW, 10)
    assert p.steps == () and p.pending[0].model == "huge"


def drained(node: Node, deadline: float | None = None) -> Node:
    return dataclasses.replace(node, mark=Mark.DRAINING, drain_deadline=deadline)


def test_drain_replaces_before_it_stops() -> None:
    c = catalog({"name": "a", "replicas": 2})
    d = c.models[0].engine_digest
    fleet = [drained(nodes(2)[0], NOW + 60), nodes(2)[1]]
    table = [replica("r0", "a", d, node="n0", gpu=0), replica("r1", "a", d, node="n1", gpu=0)]
    first = plan(c, table, {"r0", "r1"}, fleet, set(), NOW, 10)
    assert not first.stop  # r0 serves until its replacement does
    [new] = first.new
    assert new.shards[0].node == "n1"  # never onto the draining node
    assert new.reason.startswith("replaces r0 (node draining); spread: the node with")
    moved = Replica("r2", "a", d, new.shards, NOW)
    starting = plan(c, [*table, moved], {"r0", "r1"}, fleet, set(), NOW, 10)
    assert not starting.changes
    served = plan(c, [*table, moved], {"r0", "r1", "r2"}, fleet, set(), NOW, 10)
    assert [(s.replica_id, s.reason) for s in served.stop] == [("r0", "node draining")]
    assert not served.new


def test_drain_of_the_only_node_that_fits_finishes_after_its_grace_period() -> None:
    c = catalog({"name": "wide", "gpus_per_shard": 4})
    d = c.models[0].engine_digest
    wide = Replica("w", "wide", d, (ShardPlacement("n0", (0, 1, 2, 3)),), 1.0)
    fleet = [drained(nodes(1)[0], NOW + 60)]
    waiting = plan(c, [wide], {"w"}, fleet, set(), NOW, 10)
    assert not waiting.stop and waiting.pending  # nowhere to go: it keeps serving meanwhile
    over = plan(c, [wide], {"w"}, fleet, set(), NOW + 60, 10)
    [stop] = over.stop
    assert stop.reason.startswith("node drained: its grace period is over, and no replacement")
    assert stop.drops_capacity  # a warning, not a normal step (issue 41)
    unbounded = plan(c, [wide], {"w"}, [drained(nodes(1)[0], None)], set(), NOW + 1e6, 10)
    assert not unbounded.stop


def test_a_replica_not_serving_on_a_draining_node_stops_at_once() -> None:
    c = catalog({"name": "a"})
    d = c.models[0].engine_digest
    p = plan(c, [replica("r0", "a", d)], set(), [drained(nodes(2)[0]), nodes(2)[1]], set(), NOW, 10)
    assert [s.replica_id for s in p.stop] == ["r0"] and p.new[0].shards[0].node == "n1"


def test_a_replica_that_failed_too_often_is_placed_anew_elsewhere() -> None:
    c = catalog({"name": "a"})
    d = c.models[0].engine_digest
    why = "failed 3 times in a row on n0: engine exited (1)"
    p = plan(
        c, [replica("r0", "a", d)], set(), nodes(2), set(), NOW, 10, {"r0": why}, {"a": {"n0": why}}
    )
    assert [(s.replica_id, s.reason) for s in p.stop] == [("r0", why)]
    assert [s.node for r in p.new for s in r.shards] == ["n1"]
    # With nowhere else to go it waits, and says why the node it failed on is not used.
    p = plan(c, [], set(), nodes(1), set(), NOW, 10, {}, {"a": {"n0": why}})
    assert not p.new
    assert "avoided: a replica of a failed here" in " ".join(
        p.pending[0].explanation.verdicts[0].reasons
    )


def test_replicas_of_a_lost_node_are_replaced_before_they_are_stopped() -> None:
    c = catalog({"name": "a"})
    d = c.models[0].engine_digest
    silent = dataclasses.replace(nodes(2)[0], last_report=NOW - 61)
    fleet = [silent, nodes(2)[1]]
    table = [replica("r0", "a", d, node="n0")]
    assert not plan(c, table, {"r0"}, fleet, set(), NOW, 10, lost_after=120).changes
    first = plan(c, table, {"r0"}, fleet, set(), NOW, 10, lost_after=60)
    assert not first.stop and [s.node for r in first.new for s in r.shards] == ["n1"]
    moved = Replica("r1", "a", d, first.new[0].shards, NOW)
    done = plan(c, [*table, moved], {"r0", "r1"}, fleet, set(), NOW, 10, lost_after=60)
    assert [(s.replica_id, s.reason) for s in done.stop] == [("r0", "node lost: no report for 61s")]


def test_a_pending_explanation_is_an_unplaceable_even_when_place_finds_room() -> None:
    """The pass's free-GPU index saw no room but a full `place` finds some (they disagree, or
    the fleet changed since): the explanation says where it fits instead of failing."""
    placed = Placed((ShardPlacement("n1", (0,)),), verdicts=())
    pending = Pending("m", 1, lambda: placed)
    assert isinstance(pending.explanation, Unplaceable)
    assert "n1[0] fits now" in pending.explanation.summary
    refused = Unplaceable("m", "no node has a free GPU", ())
    assert Pending("m", 1, lambda: refused).explanation is refused


def test_a_replica_on_a_gpu_that_turns_unhealthy_is_replaced_before_it_stops() -> None:
    c = catalog({"name": "a"})
    digest = c.models[0].engine_digest
    fleet = nodes(2)
    n0 = fleet[0]
    bad = dataclasses.replace(n0.gpus[0], healthy=False, reason="XID 79")
    fleet[0] = dataclasses.replace(n0, gpus=(bad, *n0.gpus[1:]))
    old = replica("r0", "a", digest, "n0", 0)
    p = plan(c, [old], {"r0"}, fleet, set(), NOW, 10)
    assert not p.stop  # it keeps serving until its replacement does
    [new] = p.new
    assert (new.shards[0].node, new.shards[0].gpus) != ("n0", (0,))
    placed = Replica("r1", "a", digest, new.shards, NOW)
    served = plan(c, [old, placed], {"r0", "r1"}, fleet, set(), NOW, 10)
    assert [(s.replica_id, s.reason) for s in served.stop] == [
        ("r0", "gpu 0 of n0 unhealthy: XID 79")
    ]
    assert not served.new


def test_when_every_node_is_silent_nothing_moves_until_one_reports() -> None:
    c = catalog({"name": "a", "replicas": 2})
    digest = c.models[0].engine_digest
    table = [replica("r0", "a", digest, "n0"), replica("r1", "a", digest, "n1")]
    silent = [dataclasses.replace(n, last_report=NOW - 120) for n in nodes(2)]
    frozen = plan(c, table, {"r0", "r1"}, silent, set(), NOW, 10, lost_after=60)
    assert not frozen.changes and "every node has been silent" in frozen.frozen
    one_back = [silent[0], dataclasses.replace(silent[1], last_report=NOW)]
    moving = plan(c, table, {"r0", "r1"}, one_back, set(), NOW, 10, lost_after=60)
    assert not moving.frozen and [r.shards[0].node for r in moving.new] == ["n1"]


def test_at_most_max_parallel_replacements_start_at_once() -> None:
    fleet = [drained(nodes(2)[0]), nodes(2)[1]]
    for parallel, first in ((1, 1), (2, 2), (3, 3)):
        c = catalog({"name": "a", "replicas": 3, "max_parallel": parallel})
        digest = c.models[0].engine_digest
        table = [replica(f"r{g}", "a", digest, "n0", g) for g in range(3)]
        serving = {"r0", "r1", "r2"}
        p = plan(c, table, serving, fleet, set(), NOW, 10)
        assert len(p.new) == first and not p.stop, parallel
    # One replacement starting (placed, not yet serving): no second one until it serves.
    c = catalog({"name": "a", "replicas": 3})
    digest = c.models[0].engine_digest
    table = [replica(f"r{g}", "a", digest, "n0", g) for g in range(3)]
    starting = replica("new", "a", digest, "n1", 0)
    p = plan(c, [*table, starting], {"r0", "r1", "r2"}, fleet, set(), NOW, 10)
    assert not p.new and not p.stop
    served = plan(c, [*table, starting], {"r0", "r1", "r2", "new"}, fleet, set(), NOW, 10)
    assert len(served.stop) == 1 and len(served.new) == 1


def test_a_placed_replica_says_it_replaces_only_one_still_going() -> None:
    """Issue 57: once a replacement served, its replica stopped and the next one placed said
    it "replaces" that same replica (replaced already)."""
    fleet = [drained(nodes(2)[0]), nodes(2)[1]]
    c = catalog({"name": "a", "replicas": 3})
    digest = c.models[0].engine_digest
    table = [replica(f"r{g}", "a", digest, "n0", g) for g in range(3)]
    [first] = plan(c, table, {"r0", "r1", "r2"}, fleet, set(), NOW, 10).new
    assert first.reason.startswith("replaces r0 (node draining)")
    new = Replica("new", "a", digest, first.shards, NOW)
    served = plan(c, [*table, new], {"r0", "r1", "r2", "new"}, fleet, set(), NOW, 10)
    assert [s.replica_id for s in served.stop] == ["r0"]  # replaced by `new`, which serves
    [second] = served.new
    assert second.reason.startswith("replaces r1 (node draining)")


def test_replicas_on_a_lost_node_are_all_replaced_at_once() -> None:
    c = catalog({"name": "a", "replicas": 3})
    digest = c.models[0].engine_digest
    lost = dataclasses.replace(nodes(2)[0], last_report=NOW - 120)
    table = [replica(f"r{g}", "a", digest, "n0", g) for g in range(3)]
    p = plan(c, table, {"r0", "r1", "r2"}, [lost, nodes(2)[1]], set(), NOW, 10, lost_after=60)
    assert len(p.new) == 3


def test_rebalance_moves_the_newest_of_a_fuller_node_until_the_spread_is_even() -> None:
    """After a drain and an uncordon every replica is where the drain put it: rebalance says
    what to move, and a plan carries it out make-before-break, max_parallel at a time."""
    c = catalog(
        {"name": "a", "replicas": 4},
        {"name": "packed", "replicas": 2, "placement": "pack"},
        {"name": "wide", "shards": 2},
    )
    digest = c.models[0].engine_digest
    table = [replica(f"r{g}", "a", digest, "n0", g, created=g) for g in range(4)]
    fleet = nodes(2)
    moves = rebalance(c, table, fleet, set(), NOW, 10)
    # n0 4, n1 0: two move, the newest first; then 2 and 2. Pack and multi-shard models are
    # never moved by it.
    assert [(m.replica_id, m.from_node, m.to_node) for m in moves] == [
        ("r3", "n0", "n1"),
        ("r2", "n0", "n1"),
    ]
    assert "n0 held 4 replicas of a, n1 0" in moves[0].reason
    assert rebalance(c, table, fleet, set(), NOW, 10, models={"packed"}) == ()
    moving = {m.replica_id: m.reason for m in moves}
    serving = {r.id for r in table}
    first = plan(c, table, serving, fleet, set(), NOW, 10, moving=moving)
    new_a = [n.shards[0].node for n in first.new if n.model == "a"]
    assert new_a == ["n1"] and not first.stop  # one at a time
    started = replica("new1", "a", digest, "n1", 0, created=10)
    second = plan(c, [*table, started], serving | {"new1"}, fleet, set(), NOW, 10, moving=moving)
    [stopped] = second.stop  # the first replacement serves: one mover leaves
    assert stopped.replica_id in moving and stopped.reason.startswith("rebalance:")
    assert [n.shards[0].node for n in second.new if n.model == "a"] == ["n1"]
    # Nothing moves where no other node has room, or where the spread is even already.
    full = [dataclasses.replace(fleet[0]), dataclasses.replace(fleet[1], gpus=())]
    assert rebalance(c, table, full, set(), NOW, 10) == ()
    even = [replica(f"e{g}", "a", digest, f"n{g % 2}", g // 2) for g in range(4)]
    assert rebalance(c, even, fleet, set(), NOW, 10) == ()
    cordoned = [fleet[0], dataclasses.replace(fleet[1], mark=Mark.CORDONED)]
    assert rebalance(c, table, cordoned, set(), NOW, 10) == ()


def test_replicas_of_a_revoked_node_are_replaced_as_a_lost_nodes_and_it_freezes_nothing() -> None:
    """A revoked node is cut off on purpose: its replicas are all replaced at once (not held
    back to max_parallel), each stops once its replacement serves, nothing new lands on it,
    and it does not count among the silent nodes that freeze the fleet."""
    c = catalog({"name": "a", "replicas": 2, "max_parallel": 1})
    digest = c.models[0].engine_digest
    revoked = dataclasses.replace(nodes(2)[0], mark=Mark.REVOKED)
    fleet = [revoked, nodes(2)[1]]
    table = [replica("r0", "a", digest, "n0", 0), replica("r1", "a", digest, "n0", 1)]
    first = plan(c, table, {"r0", "r1"}, fleet, set(), NOW, 10, lost_after=60)
    assert not first.stop and [s.node for r in first.new for s in r.shards] == ["n1", "n1"]
    moved = [Replica(f"m{i}", "a", digest, r.shards, NOW) for i, r in enumerate(first.new)]
    done = plan(c, table + moved, {"r0", "r1", "m0", "m1"}, fleet, set(), NOW, 10, lost_after=60)
    assert {(s.replica_id, s.reason) for s in done.stop} == {
        ("r0", "node revoked by an operator"),
        ("r1", "node revoked by an operator"),
    }
    # The other node silent too: that one is the fleet's fault (frozen), the revoked one not.
    silent = [revoked, dataclasses.replace(nodes(2)[1], last_report=NOW - 120)]
    table = [replica("r0", "a", digest, "n0", 0), replica("r1", "a", digest, "n1", 0)]
    p = plan(c, table, {"r0", "r1"}, silent, set(), NOW, 10, lost_after=60)
    assert "every node has been silent" in p.frozen and not p.stop


def test_a_model_that_follows_its_load_gets_the_autoscaler_count_and_loses_its_least_loaded() -> (
    None
):
    scaled = {"min": 0, "max": 4, "target_in_flight": 2}
    c = catalog({"name": "a", "autoscale": scaled, "max_parallel": 3})
    digest = c.models[0].engine_digest
    assert c.models[0].replicas == 0  # the least the control plane keeps, before any decision
    p = plan(c, [], set(), nodes(), set(), NOW, 10, wanted={"a": 3})
    assert len(p.new) == 3 and all("3 wanted" in n.reason for n in p.new)

    table = [replica(f"a-{i}", "a", digest, gpu=i, created=float(i)) for i in range(3)]
    serving = {r.id for r in table}
    load = {"a-0": 5.0, "a-1": 0.0, "a-2": 3.0}
    p = plan(c, table, serving, nodes(), set(), NOW, 10, wanted={"a": 2}, load=load)
    assert [(s.replica_id, s.reason) for s in p.stop] == [("a-1", "scaled down to 2")]
    # Without loads, the newest goes, as for a fixed count.
    p = plan(c, table, serving, nodes(), set(), NOW, 10, wanted={"a": 2})
    assert [s.replica_id for s in p.stop] == ["a-2"]
    # To zero: every replica goes.
    p = plan(c, table, serving, nodes(), set(), NOW, 10, wanted={"a": 0})
    assert sorted(s.replica_id for s in p.stop) == ["a-0", "a-1", "a-2"] and not p.new


def test_idle_replicas_of_a_sleeping_model_sleep_and_are_woken_before_any_is_placed() -> None:
    scaled = {"min": 0, "max": 3, "target_in_flight": 2}
    c = catalog({"name": "a", "autoscale": scaled, "idle_action": "sleep"})
    digest = c.models[0].engine_digest
    table = [replica(f"a-{i}", "a", digest, gpu=i, created=float(i)) for i in range(3)]
    serving = {r.id for r in table}
    load = {"a-0": 1.0, "a-1": 0.0, "a-2": 4.0}
    p = plan(c, table, serving, nodes(), set(), NOW, 10, wanted={"a": 1}, load=load)
    assert sorted(s.replica_id for s in p.sleep) == ["a-0", "a-1"]  # the least loaded two
    assert not p.stop and not p.new

    # Scaled up again: the sleeping ones are woken, the newest first, before any is placed.
    asleep = {"a-0", "a-1"}
    awake = serving - asleep
    p = plan(c, table, awake, nodes(), set(), NOW, 10, wanted={"a": 2}, asleep=asleep)
    assert [w.replica_id for w in p.wake] == ["a-1"] and not p.new and not p.stop
    p = plan(c, table, awake, nodes(), set(), NOW, 10, wanted={"a": 3}, asleep=asleep)
    assert sorted(w.replica_id for w in p.wake) == ["a-0", "a-1"] and not p.new
    # Sleeping replicas keep their GPUs (level 1): nothing else is placed on them.
    other = {"name": "b", "gpus_per_shard": 4}
    c2 = catalog({"name": "a", "autoscale": scaled, "idle_action": "sleep"}, other)
    one = nodes(1)
    p = plan(c2, table, awake, one, set(), NOW, 10, wanted={"a": 1}, asleep=asleep)
    assert [pending.model for pending in p.pending] == ["b"] and not p.stop


def test_gpus_of_replicas_asleep_at_level_2_go_to_a_model_with_no_room_otherwise() -> None:
    scaled = {"min": 0, "max": 3, "target_in_flight": 2}
    sleepy = {"name": "a", "autoscale": scaled, "idle_action": "sleep", "sleep_level": 2}
    c = catalog(sleepy, {"name": "b", "gpus_per_shard": 2})
    digest = c.models[0].engine_digest
    table = [replica(f"a-{i}", "a", digest, gpu=i, created=float(i)) for i in range(4)]
    asleep = {"a-0", "a-1", "a-2"}
    p = plan(c, table, {"a-3"}, nodes(1), set(), NOW, 10, wanted={"a": 1}, asleep=asleep)
    # b needs two GPUs: two sleeping replicas are stopped for it; a-3 serves and stays.
    assert [pending.model for pending in p.pending] == ["b"]
    stopped = sorted(s.replica_id for s in p.stop)
    assert len(stopped) == 2 and set(stopped) <= asleep
    assert all("go to a replica of b" in s.reason for s in p.stop)


def test_a_scale_up_starts_at_most_max_parallel_replicas_at_once() -> None:
    scaled = {"min": 0, "max": 4, "target_in_flight": 2}
    c = catalog({"name": "a", "autoscale": scaled, "max_parallel": 2})
    digest = c.models[0].engine_digest
    p = plan(c, [], set(), nodes(), set(), NOW, 10, wanted={"a": 4})
    assert len(p.new) == 2
    table = [replica(f"a-{i}", "a", digest, gpu=i) for i in range(2)]
    p = plan(c, table, {"a-0"}, nodes(), set(), NOW, 10, wanted={"a": 4})
    assert len(p.new) == 1  # one is still starting
    p = plan(c, table, {"a-0", "a-1"}, nodes(), set(), NOW, 10, wanted={"a": 4})
    assert len(p.new) == 2
