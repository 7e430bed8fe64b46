"""Each term starts fresh (`controlplane/term.py`): a control plane that leads again, after
an election or after its acting lapsed, knows nothing of the fleet it saw before; it settles
until the nodes that held replicas report, and publishes no table before. Issue 38: a control
plane that won the lease again pushed a table 40 ms after, declared live nodes lost ("no word
for 131 s") and stopped a healthy replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.leadership import Turn
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.roster import ROSTER_EVERY_S
from modelfleet.messages.wire import AgentReport, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

from .test_controlplane import FakeClock

TOKEN = "admin-token-123"
MODEL = {"name": "m", "engine": "sim", "replicas": 2}


def start(folder: Path, clock: FakeClock, **config: object) -> ControlPlane:
    """A control plane on the store in `folder` (its state dir too)."""
    catalogs = CatalogKeeper(SqliteStore(folder / "store.sqlite"))
    if not catalogs.has_catalog:
        catalogs.lead(clock.time())
        catalogs.apply(yaml.safe_dump({"models": [MODEL]}), "api", clock.time())
    settings = ControlPlaneConfig(
        admin_token=TOKEN, state_dir=folder / "state", lease_ttl=3.0, **config
    )
    return ControlPlane(settings, catalogs, clock=clock)


class Agents:
    """Nodes a and b: each runs what it was assigned (every shard ready at once) and reports
    what it runs, to whichever term asks."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.seq = 0
        self.running: dict[str, list[ShardReport]] = {"a": [], "b": []}

    def report(self) -> None:
        cp, self.seq = self.cp, self.seq + 1
        catalog = cp.catalogs.current
        for node, shards in self.running.items():
            report = AgentReport(node=node, boot_id="b", seq=self.seq, address="127.0.0.1",
                                 gpus=SimulatedGpus("1x80GB").gpus(), shards=shards)  # fmt: skip
            cp.state.take_report(report, catalog, cp.clock.monotonic())

    def run_assigned(self) -> None:
        catalog = self.cp.catalogs.current
        for node in self.running:
            self.running[node] = [
                ShardReport.of(a, ShardState.READY, port=9000 + a.rank, pid=100)
                for a in self.cp.assignments.of(node, catalog).shards
            ]
        self.report()


def serving_and_kept(cp: ControlPlane, clock: FakeClock) -> Agents:
    """Nodes a and b past `cp`'s settling (30 s), each running the replica placed on it, and
    the roster of them kept in the store: what a restarted control plane takes over."""
    agents = Agents(cp)
    agents.report()
    clock.advance(31)
    agents.report()
    cp.reconcile_once(clock.monotonic())
    agents.run_assigned()
    clock.advance(ROSTER_EVERY_S)
    asyncio.run(cp.roster.keep(cp.term))
    assert cp.store.get_meta("roster") == '["a", "b"]'
    return agents


def test_a_control_plane_whose_acting_lapsed_begins_a_new_term_from_nothing(
    tmp_path: Path,
) -> None:
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=5)
    first, agents = cp.term, Agents(cp)
    agents.report()
    clock.advance(6)
    agents.report()
    cp.reconcile_once(clock.monotonic())  # settled: places both replicas
    agents.run_assigned()
    cp.reconcile_once(clock.monotonic())
    assert len(cp.state.replicas) == 2 and cp.plans >= 1

    async def frozen_then_thawed() -> Turn:
        clock.advance(131)  # SIGSTOPped past its lease; nobody else took it
        return await cp.renew_lease()

    assert asyncio.run(frozen_then_thawed()) is Turn.ELECTED
    assert cp.term is not first and cp.term.epoch == first.epoch  # the same lease, a new term
    assert cp.state.nodes == {} and cp.state.replicas == {}  # nothing of what it saw
    now = clock.monotonic()
    assert cp.settling(now)
    cp.reconcile_once(now)
    cp.publish()
    assert cp.passes == 0 and cp.publisher.version == 0  # no plan, no table
    # Its agents report again: their replicas are adopted, nothing placed or stopped, and no
    # node is taken for lost.
    agents.report()
    cp.reconcile_once(clock.monotonic())
    cp.record_news()
    events = [e.reason for e in cp.read_events()]
    assert "NodeLost" not in events and "NodeStale" not in events
    ids = sorted(cp.state.replicas)
    assert len(ids) == 2 and sorted(first.state.replicas) == ids


def test_a_term_settles_until_the_nodes_that_held_replicas_report_and_no_longer(
    tmp_path: Path,
) -> None:
    """The roster the term before kept: a new leader (no known_nodes given) settles until
    those nodes have reported, then plans at once, without waiting out a timer."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=30)
    serving_and_kept(cp, clock)
    cp.store.close()

    clock.advance(1)
    again = start(tmp_path, clock, settle_for=30)  # a restart: a new term, the roster read
    assert again.term.roster == frozenset({"a", "b"})
    catalog = again.catalogs.current
    report = AgentReport(node="a", boot_id="b", seq=9, address="127.0.0.1",
                         gpus=SimulatedGpus("1x80GB").gpus(), shards=[])  # fmt: skip
    again.state.take_report(report, catalog, clock.monotonic())
    clock.advance(1)
    assert again.settling(clock.monotonic())  # b, which held replicas, has not reported
    report = report.model_copy(update={"node": "b"})
    again.state.take_report(report, catalog, clock.monotonic())
    assert not again.settling(clock.monotonic())  # both did: settled, long before 30 s


def test_a_term_that_takes_a_fleet_over_says_so_once_not_once_per_node_and_shard(
    tmp_path: Path,
) -> None:
    """10,000 nodes coming back to a restarted control plane made 30,000 events (a
    NodeReported per node, a ShardAdopted per shard), a third of the kept history pushed out at
    each restart. While a term that takes a fleet over settles, they are held back, and it
    tells what it took over once when it has settled; a node new after that is told as
    before."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=30)
    agents = serving_and_kept(cp, clock)
    cp.record_news()
    before = {e.id for e in cp.read_events()}
    cp.store.close()

    clock.advance(1)
    again = start(tmp_path, clock, settle_for=30)
    agents.cp = again
    agents.report()  # both nodes, each with its replica serving
    again.record_news()
    assert again.settling(clock.monotonic()) is False  # both waited for have reported
    again.record_news()
    late = AgentReport(node="c", boot_id="b", seq=1, address="127.0.0.1", gpus=[], shards=[])
    again.state.take_report(late, again.catalogs.current, clock.monotonic())
    again.record_news()
    told = [(e.reason, e.regarding, e.message) for e in again.read_events() if e.id not in before]
    assert [t for t in told if t[0] in ("NodeReported", "ShardAdopted")] == [
        ("NodeReported", "node/c", "0 GPU(s) at 127.0.0.1")
    ]
    assert [t for t in told if t[0] == "FleetTakenOver"] == [
        (
            "FleetTakenOver",
            "fleet/all",
            "settled after 0.0s: 2 node(s) reported (2 waited for); 2 replica(s) found serving "
            "on them taken over as they run (2 shard(s))",
        )
    ]


def test_a_term_settled_before_every_node_reported_says_so_and_tells_the_rest_later(
    tmp_path: Path,
) -> None:
    """Issue 57: settled by its bound while agents still talked to another control plane,
    a term said "0 replica(s) found serving" of a fleet where they all served."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=30)
    agents = serving_and_kept(cp, clock)
    cp.store.close()
    clock.advance(1)
    again = start(tmp_path, clock, settle_for=5, node_lost_after=10)
    agents.cp = again
    b = agents.running.pop("b")
    agents.report()  # a only
    clock.advance(11)
    assert again.settling(clock.monotonic()) is False  # by its bound: b never reported
    agents.running["b"] = b
    agents.report()
    again.record_news()
    told = {e.reason: e for e in again.read_events()}
    assert told["FleetTakenOver"].message == (
        "settled after 11.0s: 1 node(s) reported; 1 of the 2 waited for not yet: what runs "
        "there is taken over as they report; 1 replica(s) found serving on them taken over "
        "as they run (1 shard(s))"
    )
    assert told["ShardAdopted"].message.startswith("shard 0 on b serving")


def test_a_term_that_settled_by_its_bound_keeps_waiting_for_the_roster_it_began_with(
    tmp_path: Path,
) -> None:
    """Its agents (but one) still talked to a frozen leader when the bound passed: the roster
    it keeps still names the nodes it waited for and never heard (until they would be
    forgotten), or the term after it would settle at once and place anew what those nodes
    run."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    timing = {
        "settle_for": 5,
        "node_stale_after": 5,
        "node_lost_after": 10,
        "node_forget_after": 100,
    }
    cp = start(tmp_path, clock, **timing)
    cp.store.set_meta("roster", '["a", "b"]')
    cp.store.close()
    again = start(tmp_path, clock, **timing)
    assert again.term.roster == frozenset({"a", "b"})
    report = AgentReport(node="c", boot_id="b", seq=1, address="127.0.0.1", gpus=[], shards=[])
    again.state.take_report(report, again.catalogs.current, clock.monotonic())
    clock.advance(11)  # the bound: neither a nor b reported
    assert not again.settling(clock.monotonic())
    clock.advance(ROSTER_EVERY_S)
    asyncio.run(again.roster.keep(again.term))
    assert again.store.get_meta("roster") == '["a", "b"]'
    report = report.model_copy(update={"node": "a"})
    again.state.take_report(report, again.catalogs.current, clock.monotonic())
    assert again.term.roster_now(clock.monotonic()) == frozenset({"b"})  # a holds nothing
    clock.advance(100)
    assert again.term.roster_now(clock.monotonic()) == frozenset()


def test_a_leader_that_took_over_plans_nothing_before_a_node_it_knows_of_has_found_it(
    tmp_path: Path,
) -> None:
    """Issue 57: after PostgreSQL came back, agents tried stale control planes for longer than
    the bound, and the one holding the lease settled with 0 nodes, then placed a replica on the
    first node that reported and retired it in the same second, once the node running the
    replica it stood in for reported too. A term that waits for nodes (the roster the store
    kept) settles until the first of them reports, however long, and its window and bound
    begin with that report."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    timing = {"settle_for": 5, "node_stale_after": 5, "node_lost_after": 10}
    cp = start(tmp_path, clock, **timing)
    agents = serving_and_kept(cp, clock)
    placed = sorted(cp.state.replicas)
    cp.store.close()

    clock.advance(1)
    again = start(tmp_path, clock, **timing)  # the new leader: the roster says a and b
    assert again.term.roster == frozenset({"a", "b"})
    clock.advance(60)  # far past the bound: its agents have not found it yet
    assert again.settling(clock.monotonic())
    again.reconcile_once(clock.monotonic())
    assert again.passes == 0 and again.state.replicas == {}
    agents.cp, agents.seq = again, agents.seq + 1
    gpus = SimulatedGpus("1x80GB").gpus()
    report = AgentReport(node="a", boot_id="b", seq=agents.seq, address="127.0.0.1",
                         gpus=gpus, shards=agents.running["a"])  # fmt: skip
    again.state.take_report(report, again.catalogs.current, clock.monotonic())
    again.reconcile_once(clock.monotonic())
    assert again.settling(clock.monotonic()) and again.passes == 0  # b is waited for
    clock.advance(2)
    agents.report()  # b too: both replicas adopted, nothing placed nor retired
    again.reconcile_once(clock.monotonic())
    assert not again.settling(clock.monotonic()) and again.passes == 1
    assert sorted(again.state.replicas) == placed
    assert not any(r.retiring for r in again.state.replicas.values())


def test_a_term_settles_while_new_nodes_still_come_and_not_past_its_bound(
    tmp_path: Path,
) -> None:
    """Without a roster or known nodes: the window is `settle_for` past the last new node, so
    a control plane still taking reports does not end it; `node_lost_after` at most."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=10, node_lost_after=60)
    catalog = cp.catalogs.current
    for i in range(8):  # a node every 8 s: the window never closes
        clock.advance(8)
        report = AgentReport(node=f"n{i}", boot_id="b", seq=1, address="127.0.0.1",
                             gpus=[], shards=[])  # fmt: skip
        cp.state.take_report(report, catalog, clock.monotonic())
        assert cp.settling(clock.monotonic()) == (clock.monotonic() - cp.term.started_at < 60)
    clock.advance(10)
    assert not cp.settling(clock.monotonic())


def test_a_control_plane_that_lost_the_lease_drops_its_term(tmp_path: Path) -> None:
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=-1)
    Agents(cp).report()
    cp.reconcile_once(clock.monotonic())
    assert cp.state.replicas
    other = SqliteStore(tmp_path / "store.sqlite")
    other.release_lease("nobody")  # (not its holder: nothing happens)
    cp.store.release_lease(cp.leadership.holder)  # as if it ran out
    assert other.take_lease("another", 30.0).holder == "another"
    assert asyncio.run(cp.renew_lease()) is Turn.LOST
    assert cp.state.replicas == {} and cp.term.epoch is None and not cp.acting()


def test_a_control_plane_elected_takes_no_change_until_its_term_has_begun(
    tmp_path: Path,
) -> None:
    """A key made while the new term read the store went into the keys the term then
    replaced with what it had read: the store kept it, the leader's answers lost it."""
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=5)
    assert cp.acting()
    seen: list[bool] = []
    read = cp._term_io

    def watched() -> object:
        seen.append(cp.acting())  # while the term's store I/O is under way
        return read()

    cp._term_io = watched  # type: ignore[method-assign]
    clock.advance(131)  # frozen past its lease; nobody took it

    assert asyncio.run(cp.renew_lease()) is Turn.ELECTED
    assert seen == [False] and cp.acting()


def test_a_control_plane_that_took_a_fleet_over_publishes_no_table_before_a_node_reports(
    tmp_path: Path,
) -> None:
    """M06: a new leader must not push an empty table to routers before it has adopted what
    runs: routers would drop every replica. It took the lease of another leader (which kept no
    roster), its settling window is over, and no node has reported yet: nothing is published.
    The first report, and it is."""
    store = SqliteStore(tmp_path / "store.sqlite")
    store.take_lease("the leader before", 0.05)
    while store.lease().remaining_s > 0:
        time.sleep(0.01)
    clock = FakeClock(wall=time.time(), mono=100.0)
    cp = start(tmp_path, clock, settle_for=5)
    assert cp.acting() and cp.leadership.took_over and cp.store.get_meta("roster") is None
    clock.advance(cp.config.node_lost_after + 60)  # past every settling bound
    assert not cp.settling(clock.monotonic())
    cp.reconcile_once(clock.monotonic())
    cp.publish()
    assert cp.publisher.version == 0  # no table, not an empty one
    Agents(cp).report()
    cp.reconcile_once(clock.monotonic())
    cp.publish()
    assert cp.publisher.version == 1


def test_a_follower_never_applies_its_own_catalog_file(tmp_path: Path) -> None:
    """M09: only the leader applies a catalog file. A follower whose file holds another
    catalog, at its start and edited while it runs, applies nothing: the store's catalog
    stays the leader's, and the follower says why the file was not applied."""
    store = SqliteStore(tmp_path / "store.sqlite")
    leader = CatalogKeeper(store)
    leader.lead(time.time())
    version = leader.apply(yaml.safe_dump({"models": [MODEL]}), "api", time.time()).catalog.version
    store.take_lease("the leader", 60.0)
    file = tmp_path / "catalog.yaml"
    file.write_text(yaml.safe_dump({"models": [{"name": "mine", "engine": "sim"}]}))
    clock = FakeClock(wall=time.time(), mono=100.0)
    catalogs = CatalogKeeper(SqliteStore(tmp_path / "store.sqlite"), file, tmp_path / "seen")
    settings = ControlPlaneConfig(admin_token=TOKEN, state_dir=tmp_path / "state", catalog=file,
                                  catalog_poll_interval=0.01, lease_ttl=3.0)  # fmt: skip
    cp = ControlPlane(settings, catalogs, clock=clock)
    assert not cp.acting() and cp.leadership.leader == "the leader"

    async def until(what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            clock.advance(0.05)  # the watcher takes a file once it reads the same 0.2 s apart
            await asyncio.sleep(0.01)

    def read() -> bool:  # the file as it is now, read by the follower
        return catalogs._file_stat is not None and catalogs._file_stat[1] == file.stat().st_size

    async def polled() -> None:
        task = asyncio.create_task(cp.catalog_file.run())
        try:
            await until("the follower to say its file is not applied (or to apply it)",
                        lambda: "not applied" in cp.catalog_file._said
                        or catalogs.current.version != version)  # fmt: skip
            file.write_text(yaml.safe_dump({"models": [{"name": "edited", "engine": "sim"}]}))
            await until("the follower to read the edit", read)
            for _ in range(5):  # a few more polls
                await asyncio.sleep(0.02)
        finally:
            task.cancel()

    asyncio.run(polled())
    latest = SqliteStore(tmp_path / "store.sqlite").latest_catalog()
    assert latest is not None and latest.version == version
    assert [m.name for m in cp.catalogs.current.models] == ["m"]
