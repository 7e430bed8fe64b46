"""The reconcile planner: (catalog, fleet, replicas, clock) -> what to change.

Pure: the control plane calls `plan` on every pass with what it knows and carries out the
answer. Every replica in the table is visited on every pass, including those whose model is
no longer in the catalog: those are stopped, so nothing keeps GPUs for a name no client can ask
for.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Literal

from modelfleet.core.catalog import Catalog, ModelSpec
from modelfleet.core.fleet import Mark, Node, Replica, ShardPlacement
from modelfleet.core.placement import RULES, FreeGpus, Placed, Unplaceable, place


@dataclass(frozen=True)
class NewReplica:
    """A replica to create, already placed."""

    model: str
    engine_digest: str
    shards: tuple[ShardPlacement, ...]
    reason: str = ""  # why it is made: what it replaces, or the count it fills


@dataclass(frozen=True)
class StopReplica:
    """A replica to take out of service, and why (shown to operators)."""

    replica_id: str
    reason: str
    # Stopped though nothing replaces it yet (a drain's grace period over): its model serves
    # with one replica fewer until a replacement does.
    drops_capacity: bool = False


@dataclass(frozen=True)
class SleepReplica:
    """A replica of a model whose idle replicas sleep, to put to sleep (`idle_action`)."""

    replica_id: str
    reason: str


@dataclass(frozen=True)
class WakeReplica:
    """A sleeping replica to wake: its model needs it again."""

    replica_id: str
    reason: str


@dataclass(frozen=True)
class Pending:
    """Replicas of a model that are wanted but cannot be placed now, and why.

    The explanation judges every node, so it is worked out only when someone reads it, by
    `explain` (a full `place`). When that finds room after all (the pass's free-GPU index saw
    none: the two disagree, or the fleet changed since), the explanation still says so as an
    `Unplaceable`, naming where `place` would put the replica.
    """

    model: str
    count: int
    explain: Callable[[], Placed | Unplaceable] = field(repr=False, compare=False)

    @cached_property
    def explanation(self) -> Unplaceable:
        found = self.explain()
        if isinstance(found, Unplaceable):
            return found
        where = ", ".join(f"{s.node}{list(s.gpus)}" for s in found.shards)
        summary = f"not placed in the last pass, though {where} fits now; the next pass places it"
        return Unplaceable(self.model, summary, found.verdicts)


@dataclass(frozen=True)
class Plan:
    """The changes one pass decided on. Empty when desired and actual agree."""

    new: tuple[NewReplica, ...] = ()
    stop: tuple[StopReplica, ...] = ()
    pending: tuple[Pending, ...] = ()
    frozen: str = ""  # why nothing is moved off lost nodes this pass (every node is silent)
    sleep: tuple[SleepReplica, ...] = ()
    wake: tuple[WakeReplica, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.new or self.stop or self.sleep or self.wake)


def settling(
    now: float,
    started_at: float,
    settle_for: float,
    bound: float,
    quiet_since: float,
    waited_reported: bool | None,
) -> bool:
    """Whether a term is still in its settling window: it adopts what agents report, and
    neither places nor tears down.

    It ends once every node it waits for (those that held replicas, the known nodes) has
    reported (`waited_reported`; None: it waits for no node by name); or once no node new to
    the term has reported since `quiet_since` for `settle_for` seconds, so that a control
    plane busy taking reports as fast as it can does not end it while they still come; and
    `bound` seconds after `started_at` at most. `settle_for` negative: no window at all.
    """
    if settle_for < 0 or waited_reported:
        return False
    return now - quiet_since < settle_for and now - started_at < bound


def plan(
    catalog: Catalog,
    replicas: Sequence[Replica],
    serving: Collection[str],
    nodes: Sequence[Node],
    busy: Collection[tuple[str, int]],
    now: float,
    stale_after: float,
    failed: Mapping[str, str] = MappingProxyType({}),
    avoid: Mapping[str, Mapping[str, str]] = MappingProxyType({}),
    lost_after: float | None = None,
    models: Collection[str] | None = None,
    moving: Mapping[str, str] = MappingProxyType({}),
    wanted: Mapping[str, int] = MappingProxyType({}),
    load: Mapping[str, float] = MappingProxyType({}),
    asleep: Collection[str] = frozenset(),
) -> Plan:
    """Decide one pass.

    `replicas` is the control plane's table; `serving` the ids of those whose every shard is
    ready; `busy` the GPU slots agents report in use beyond the table (an engine still
    stopping holds its GPUs until it exits). `failed` maps the replicas that failed too often
    to why: they are stopped and placed anew, off the nodes `avoid` keeps each model from
    (model -> node -> why). A node silent for longer than `lost_after` is lost: its replicas
    are replaced elsewhere as a drain would replace them, and so are those on a node an
    operator revoked. When every node (bar revoked ones) is silent that long, the fault is the
    control plane's or its network's, not the nodes': nothing is moved off them (`Plan.frozen`
    says why) until one reports again.

    With `models`, only those models of the catalog are planned (replicas of models gone from
    it are stopped all the same): the control plane passes the models something changed for,
    when nothing changed that concerns the others (`ControlPlane.reconcile_once`).

    `moving` maps replicas an operator asked to move (`rebalance`) to why: each serving one
    is replaced as a drain replaces one, make-before-break and `max_parallel` at a time.

    `wanted` gives the replica count of the models that follow their load (`autoscale`), in
    place of the catalog's; `load` the requests each replica carries, so that a scale-down
    takes the least loaded one.

    `asleep` are the replicas put to sleep (of models with `idle_action: sleep`): a model
    scaled down puts its surplus to sleep instead of stopping it, and one scaled up wakes its
    sleeping replicas before it places new ones. A sleeping replica keeps its GPUs, unless its
    model sleeps at level 2: then a replica of another model that has no room otherwise takes
    them, and the sleeping one is stopped for it.
    """
    stops: list[StopReplica] = []
    sleeps: list[SleepReplica] = []
    wakes: list[WakeReplica] = []
    new: list[NewReplica] = []
    pending: list[Pending] = []
    free: FreeGpus | None = None

    def free_gpus() -> FreeGpus:
        """The index of free GPUs, built the first time a replica is to be placed."""
        nonlocal free
        if free is None:
            used = set(busy)
            for replica in replicas:
                used.update((s.node, g) for s in replica.shards for g in s.gpus)
            free = FreeGpus.of(nodes, used, now, stale_after)
        return free

    by_model: dict[str, list[Replica]] = {}
    for replica in replicas:
        if catalog.get(replica.model) is None:
            stops.append(StopReplica(replica.id, "model removed from the catalog"))
        else:
            by_model.setdefault(replica.model, []).append(replica)

    revoked = {n.name for n in nodes if n.mark is Mark.REVOKED}
    lost = {
        n.name: f"node lost: no report for {now - n.last_report:.0f}s"
        for n in nodes
        if lost_after is not None
        and n.last_report is not None
        and now - n.last_report > lost_after
        and n.name not in revoked
    }
    frozen = ""
    if lost and len(lost) + len(revoked) == len(nodes):
        frozen = (
            f"every node has been silent for over {lost_after:.0f}s: the control plane or its "
            "network is at fault, not the nodes; nothing is moved until one reports again"
        )
        lost = {}
    # A revoked node is cut off on purpose: its replicas go as a lost node's do.
    lost |= {name: "node revoked by an operator" for name in revoked}
    leaving: dict[str, tuple[str, float | None]] = {}
    for n in nodes:
        if n.mark is Mark.DRAINING:
            leaving[n.name] = ("node draining", n.drain_deadline)
        elif n.name in lost:
            leaving[n.name] = (lost[n.name], None)
    faulty = {
        (n.name, g.index): f"gpu {g.index} of {n.name} unhealthy: {g.reason or 'no reason given'}"
        for n in nodes
        for g in n.gpus
        if not g.healthy
    }
    shared = _Pass(
        serving,
        nodes,
        leaving,
        frozenset(lost),
        faulty,
        free_gpus,
        now,
        stale_after,
        failed,
        avoid,
        moving,
        load,
        frozenset(asleep),
    )
    for spec in catalog.models:
        if models is not None and spec.name not in models:
            continue
        count = wanted.get(spec.name, spec.replicas)
        done = _plan_model(spec, count, by_model.get(spec.name, []), shared)
        stops += done.stop
        new += done.new
        sleeps += done.sleep
        wakes += done.wake
        if done.pending:
            pending.extend(done.pending)
    if pending and asleep:
        woken = {w.replica_id for w in wakes}
        lent = _lend_sleeping_gpus(catalog, replicas, pending, shared, free_gpus().used, woken)
        stops += lent
    return Plan(tuple(new), tuple(stops), tuple(pending), frozen, tuple(sleeps), tuple(wakes))


def _lend_sleeping_gpus(
    catalog: Catalog,
    replicas: Sequence[Replica],
    pending: Sequence[Pending],
    shared: _Pass,
    used: Collection[tuple[str, int]],
    woken: Collection[str],
) -> list[StopReplica]:
    """The replicas asleep at level 2 (and not woken this pass) to stop so that pending
    replicas of other models get their GPUs: one replica of each pending model is placed as if
    those GPUs were free, and the sleeping replicas on the GPUs it would take are stopped
    (their engines let go of the GPUs; a later pass places the pending replica there, and
    lends again for the next one)."""
    lendable: dict[tuple[str, int], Replica] = {}
    for r in replicas:
        spec = catalog.get(r.model)
        asleep = r.id in shared.asleep and r.id not in woken
        if asleep and spec is not None and spec.sleep_level == 2:
            lendable.update((slot, r) for slot in r.gpu_slots())
    if not lendable:
        return []
    taken = set(used) - lendable.keys()
    stops: list[StopReplica] = []
    stopped: set[str] = set()
    for p in pending:
        spec = catalog.get(p.model)
        if spec is None:
            continue
        on_node = Counter(s.node for r in replicas if r.model == spec.name for s in r.shards)
        avoid = shared.avoid.get(spec.name, MappingProxyType({}))
        found = place(spec, shared.nodes, taken, on_node, shared.now, shared.stale_after, avoid)
        if not isinstance(found, Placed):
            continue
        slots = {(s.node, g) for s in found.shards for g in s.gpus}
        taken |= slots
        for slot in sorted(slots & lendable.keys()):
            sleeper = lendable[slot]
            if sleeper.model != spec.name and sleeper.id not in stopped:
                stopped.add(sleeper.id)
                why = f"asleep at level 2: its GPUs go to a replica of {spec.name}"
                stops.append(StopReplica(sleeper.id, why))
    return stops


@dataclass(frozen=True)
class _Pass:
    """What the planning of every model in one pass shares."""

    serving: Collection[str]
    nodes: Sequence[Node]
    leaving: Mapping[str, tuple[str, float | None]]  # node -> (why, until when at the latest)
    lost: frozenset[str]  # nodes lost this pass
    faulty: Mapping[tuple[str, int], str]  # (node, gpu) -> why it is unhealthy
    free_gpus: Callable[[], FreeGpus]
    now: float
    stale_after: float
    failed: Mapping[str, str]
    avoid: Mapping[str, Mapping[str, str]]
    moving: Mapping[str, str]
    load: Mapping[str, float]  # replica id -> requests it carries
    asleep: frozenset[str]  # replicas put to sleep


@dataclass
class _ModelPlan:
    """What one model's planning decided."""

    stop: list[StopReplica] = field(default_factory=list)
    new: list[NewReplica] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    sleep: list[SleepReplica] = field(default_factory=list)
    wake: list[WakeReplica] = field(default_factory=list)


def _plan_model(spec: ModelSpec, count: int, replicas: list[Replica], shared: _Pass) -> _ModelPlan:
    """The changes for one model of `count` replicas wanted."""
    serving, now = shared.serving, shared.now
    done = _ModelPlan()
    stops = done.stop

    # A replica that failed too often is stopped and placed anew elsewhere, not restarted.
    failing = [r for r in replicas if r.id in shared.failed]
    for r in failing:
        stops.append(StopReplica(r.id, shared.failed[r.id]))
    if failing:
        replicas = [r for r in replicas if r.id not in shared.failed]

    # Replicas with a shard on a node being left (draining, or lost) or on a GPU that turned
    # unhealthy are evicted: each gets a replacement at once and stops once the replicas left
    # serving reach the wanted count, or when a draining node's grace period is over,
    # whichever comes first.
    evicted: list[tuple[Replica, str, bool]] = []  # (replica, why, on a lost node)
    kept: list[Replica] = []
    for r in replicas:
        marks = [shared.leaving[s.node] for s in r.shards if s.node in shared.leaving]
        marks += [
            (shared.faulty[(s.node, g)], None)
            for s in r.shards
            for g in s.gpus
            if (s.node, g) in shared.faulty
        ]
        if not marks and r.id in shared.moving and r.id in serving:
            evicted.append((r, shared.moving[r.id], False))
        elif not marks:
            kept.append(r)
        elif any(d is not None and now >= d for _, d in marks):
            why = (
                "node drained: its grace period is over, and no replacement serves yet: "
                f"{spec.name} has one replica fewer until one does"
            )
            stops.append(StopReplica(r.id, why, drops_capacity=True))
        elif r.id not in serving:
            stops.append(StopReplica(r.id, marks[0][0]))
        else:
            lost = any(s.node in shared.lost for s in r.shards)
            evicted.append((r, marks[0][0], lost))

    current = [r for r in kept if r.engine_digest == spec.engine_digest]
    outdated = [r for r in kept if r.engine_digest != spec.engine_digest]
    asleep = [r for r in current if r.id in shared.asleep]
    if asleep:
        current = [r for r in current if r.id not in shared.asleep]

    # Too many up-to-date replicas: stop the surplus, those not yet serving first, then the
    # least loaded, then the newest, so the longest-serving ones stay. A stop is a drain: the
    # replica leaves the routers' tables, then its engine finishes what it has in flight. A
    # model whose idle replicas sleep puts a serving one to sleep instead, the same way.
    if len(current) > count:
        load = shared.load
        ranked = sorted(
            current, key=lambda r: (r.id in serving, load.get(r.id, 0.0), -r.created, r.id)
        )
        for surplus in ranked[: len(current) - count]:
            if spec.idle_action == "sleep" and surplus.id in serving:
                why = f"scaled down to {count}: asleep until needed"
                done.sleep.append(SleepReplica(surplus.id, why))
            else:
                stops.append(StopReplica(surplus.id, f"scaled down to {count}"))
        current = ranked[len(current) - count :]

    # Replicas to replace (evicted, then the oldest outdated: engine or arguments changed) go
    # make-before-break: an old replica leaves only while the serving ones left still reach
    # the wanted count. At most `max_parallel` replacements are starting at once; those of
    # replicas on a lost node are not held back (nothing reaches them any more), nor is what
    # fills a shortfall (a new model, a scale-up, a replica stopped before it served).
    for replica in outdated:
        if replica.id not in serving:
            stops.append(StopReplica(replica.id, "engine or arguments changed"))
    serving_outdated = sorted((r for r in outdated if r.id in serving), key=lambda r: r.created)
    going = [(r, why, lost) for r, why, lost in evicted]
    going += [(r, "engine or arguments changed", False) for r in serving_outdated]
    serving_current = sum(1 for r in current if r.id in serving)
    while going and serving_current + len(going) > count:
        replica, why, _ = going.pop(0)
        stops.append(StopReplica(replica.id, why))
    # What a replica placed now replaces: one still going (those stopped above are replaced
    # already, by replicas that serve).
    replaced = [f"replaces {r.id} ({why})" for r, why, _ in going]

    new = done.new
    missing = count - len(current)
    # Too few: sleeping replicas are woken first (the most recent first), in seconds, before
    # any is placed anew.
    for sleeper in sorted(asleep, key=lambda r: (-r.created, r.id))[: max(0, missing)]:
        done.wake.append(WakeReplica(sleeper.id, f"scaled up to {count}: woken"))
    missing -= len(done.wake)
    if spec.autoscale is not None:
        # A model that follows its load starts at most `max_parallel` replicas at once, as a
        # rollout does: a burst must not start every replica it may have in one go.
        starting = sum(1 for r in current if r.id not in serving)
        missing = min(missing, max(0, spec.max_parallel - starting - len(done.wake)))
    held_back = sum(1 for _, _, lost in going if not lost)
    if held_back:
        shortfall = max(0, missing - held_back)
        starting = sum(1 for r in current if r.id not in serving)
        missing = min(missing, shortfall + max(0, spec.max_parallel - starting))
    if missing <= 0:
        return done
    on_node = Counter(s.node for r in current for s in r.shards)
    free = shared.free_gpus()
    avoid = shared.avoid.get(spec.name, MappingProxyType({}))
    for placed_so_far in range(missing):
        shards = free.claim(spec, on_node, avoid)
        if shards is None:
            pending = Pending(
                spec.name,
                missing - placed_so_far,
                functools.partial(
                    place,
                    spec,
                    shared.nodes,
                    frozenset(free.used),
                    Counter(on_node),
                    now,
                    shared.stale_after,
                    avoid,
                ),
            )
            done.pending.append(pending)
            break
        if placed_so_far < len(replaced):
            reason = replaced[placed_so_far]
        else:
            reason = f"{count} wanted, {len(current) + placed_so_far} up to date"
        reason += f"; {spec.placement}: {RULES[spec.placement]}"
        new.append(NewReplica(spec.name, spec.engine_digest, shards, reason))
        on_node.update(s.node for s in shards)
    return done


@dataclass(frozen=True)
class PreviewStep:
    """One replica started or stopped in a preview, at the pass (`step`, from 1) it happens."""

    step: int
    action: Literal["start", "stop"]
    replica: Replica
    reason: str = ""


@dataclass(frozen=True)
class Preview:
    """What applying a catalog would do, over as many passes as it takes to settle.

    `steps` are the replicas started (ids `new-1`, `new-2`, ...) and stopped, in order;
    `pending` is what would still be unplaceable at the end.
    """

    steps: tuple[PreviewStep, ...]
    pending: tuple[Pending, ...]


def preview(
    catalog: Catalog,
    replicas: Sequence[Replica],
    nodes: Sequence[Node],
    busy: Collection[tuple[str, int]],
    now: float,
    stale_after: float,
    max_passes: int = 256,
    *,
    serving: Collection[str] | None = None,
    failed: Mapping[str, str] = MappingProxyType({}),
    avoid: Mapping[str, Mapping[str, str]] = MappingProxyType({}),
    lost_after: float | None = None,
    moving: Mapping[str, str] = MappingProxyType({}),
    wanted: Mapping[str, int] = MappingProxyType({}),
    load: Mapping[str, float] = MappingProxyType({}),
    asleep: Collection[str] = frozenset(),
) -> Preview:
    """Run `plan` pass after pass until nothing changes, as if every new replica served at once
    and every stopped one let go of its GPUs one pass after it was stopped.

    The first pass plans from what the control plane's next pass plans from (the keyword
    arguments are `plan`'s; `serving` None: every replica in the table serves), so its
    steps are what that pass does. This is what `ctl catalog apply` prints. It is optimistic
    where the real fleet is not: an engine that fails to start, or a node that stops
    reporting, changes the real course.
    """
    table = {r.id: r for r in replicas}
    steps: list[PreviewStep] = []
    last = Plan()
    freeing: set[tuple[str, int]] = set()
    started = 0
    for step in range(1, max_passes + 1):
        first = step == 1
        last = plan(
            catalog,
            list(table.values()),
            serving if first and serving is not None else set(table),
            nodes,
            set(busy) | freeing,
            now,
            stale_after,
            failed if first else {},
            avoid,
            lost_after,
            moving={rid: why for rid, why in moving.items() if rid in table},
            wanted=wanted,
            load=load,
            asleep=asleep,
        )
        if not last.changes:
            break
        freeing = set()
        for stop in last.stop:
            replica = table.pop(stop.replica_id)
            freeing |= replica.gpu_slots()
            steps.append(PreviewStep(step, "stop", replica, stop.reason))
        for new in last.new:
            started += 1
            replica = Replica(f"new-{started}", new.model, new.engine_digest, new.shards, now)
            table[replica.id] = replica
            steps.append(PreviewStep(step, "start", replica))
    return Preview(tuple(steps), last.pending)


@dataclass(frozen=True)
class Move:
    """A replica to move to even out a spread model: placed anew, make-before-break."""

    replica_id: str
    model: str
    from_node: str
    to_node: str  # where the planner is expected to put its replacement
    reason: str


def rebalance(
    catalog: Catalog,
    replicas: Sequence[Replica],
    nodes: Sequence[Node],
    busy: Collection[tuple[str, int]],
    now: float,
    stale_after: float,
    models: Collection[str] | None = None,
) -> tuple[Move, ...]:
    """The moves that even out each `spread` model of one shard per replica over the nodes
    that can host it: while one node holds at least two replicas more than another node
    with room for one, the newest replica of the fuller node moves. After a drain and an
    uncordon every replica is still where the drain put it; this says how to spread them
    again. Only what is free now counts as room (a move's replacement starts before its
    original stops)."""
    used = set(busy)
    for replica in replicas:
        used.update((s.node, g) for s in replica.shards for g in s.gpus)
    moves: list[Move] = []
    for spec in catalog.models:
        if spec.placement != "spread" or spec.shards != 1:
            continue
        if models is not None and spec.name not in models:
            continue
        mine = sorted(
            (r for r in replicas if r.model == spec.name and r.engine_digest == spec.engine_digest),
            key=lambda r: (-r.created, r.id),
        )
        counts = Counter(r.shards[0].node for r in mine)
        while True:
            fullest = max(counts, key=lambda n: (counts[n], n), default=None)
            if fullest is None or counts[fullest] < 2:
                break
            room = [
                n
                for n in nodes
                if counts[n.name] <= counts[fullest] - 2
                and isinstance(place(spec, [n], used, counts, now, stale_after), Placed)
            ]
            if not room:
                break
            target = min(room, key=lambda n: (counts[n.name], n.name))
            mover = next(r for r in mine if r.shards[0].node == fullest)
            mine.remove(mover)
            placed = place(spec, [target], used, counts, now, stale_after)
            assert isinstance(placed, Placed)
            used.update((s.node, g) for s in placed.shards for g in s.gpus)
            why = (
                f"rebalance: {fullest} held {counts[fullest]} replicas of {spec.name}, "
                f"{target.name} {counts[target.name]}"
            )
            moves.append(Move(mover.id, spec.name, fullest, target.name, why))
            counts[fullest] -= 1
            counts[target.name] += 1
    return tuple(moves)
