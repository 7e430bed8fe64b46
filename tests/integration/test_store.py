"""The store's contract, held by both implementations: SQLite in a file, and PostgreSQL on a
real server (Debian's PostgreSQL, started here with initdb/pg_ctl in a temporary folder;
each test gets a database of its own). Every test runs against both."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, assume, given, settings

from modelfleet.controlplane.catalogs import API_SOURCE, CatalogKeeper
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.host.pgserver import PgServer
from modelfleet.store import (
    SCHEMA_VERSION,
    AlreadyMade,
    EventScope,
    EventWrite,
    Once,
    OutcomeUnknown,
    Rejection,
    Store,
    StoredCredential,
    StoredEvent,
    StoredJoinToken,
    StoredKey,
    StoredMark,
    StoredPoint,
    StoredUsage,
    StoreError,
    StoreUnreachable,
)
from modelfleet.store.postgres import Bounds, PostgresStore
from modelfleet.store.sql import EVENT_ROWS_PER_STATEMENT
from modelfleet.store.sqlite import SqliteStore

from ..catalog_kit import catalogs
from .conftest import Procs, wait_for


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    # Not under pytest's temporary folders: run as root, the server runs as `postgres`,
    # which cannot reach into those (they are private to root).
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-pg-"))
    server = PgServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


_databases = iter(range(1, 1_000_000))


def fresh_database(pg: PgServer) -> str:
    """A new, empty database on `pg`: its conninfo."""
    name = f"t{next(_databases)}"
    with psycopg.connect(pg.conninfo(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return pg.conninfo().rsplit("/", 1)[0] + f"/{name}"


class Opened:
    """How a test opens (and opens again) the store it is given."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind = kind
        self.where = where

    def open(self) -> Store:
        if self.kind == "sqlite":
            return SqliteStore(self.where)
        return PostgresStore(self.where)


@pytest.fixture(params=["sqlite", "postgres"])
def opened(request: pytest.FixtureRequest, tmp_path: Path) -> Opened:
    if request.param == "sqlite":
        return Opened("sqlite", str(tmp_path / "store.sqlite"))
    return Opened("postgres", fresh_database(request.getfixturevalue("pg")))


@pytest.fixture
def store(opened: Opened) -> Iterator[Store]:
    s = opened.open()
    yield s
    s.close()


def test_catalogs_are_versioned_one_after_another_and_kept(store: Store, opened: Opened) -> None:
    assert store.latest_catalog() is None and store.catalog_history(5) == []
    body = {"models": [{"name": "m", "engine": "sim", "replicas": 2}]}
    assert store.add_catalog("d1", 10.0, "api", body) == 1
    assert store.add_catalog("d2", 20.0, "/etc/catalog.yaml", {"models": []}) == 2
    latest = store.latest_catalog()
    assert latest is not None and (latest.version, latest.digest, latest.source) == (
        2,
        "d2",
        "/etc/catalog.yaml",
    )
    assert [c.version for c in store.catalog_history(5)] == [2, 1]
    assert store.catalog_history(1)[0].body == {"models": []}
    assert store.catalog_history(5)[1].body == body
    assert store.last_rejection() is None
    store.set_rejection(Rejection(30.0, "api", ("models[0].engine: unknown", "second")))
    assert store.last_rejection() == Rejection(30.0, "api", ("models[0].engine: unknown", "second"))
    store.close()
    again = opened.open()  # what was written is there after a new open
    assert [c.digest for c in again.catalog_history(5)] == ["d2", "d1"]
    again.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(models=catalogs())
def test_every_accepted_catalog_is_stored_and_read_back_equal(
    opened: Opened, models: list[dict[str, Any]]
) -> None:
    """accept -> store -> read (by a keeper opened anew, as a restarted control plane's) ->
    equal -> valid, over catalogs drawn across every field."""
    try:
        catalog = Catalog.new(models)
    except CatalogInvalid:
        assume(False)
    store = opened.open()
    try:
        applied = CatalogKeeper(store).apply(json.dumps(catalog.to_dict()), API_SOURCE, 1.0)
    finally:
        store.close()
    store = opened.open()
    try:
        again = CatalogKeeper(store).current
    finally:
        store.close()
    assert again.version == applied.catalog.version
    assert again.models == catalog.models and again.digest == catalog.digest


def test_marks_and_meta_replace_and_clear(store: Store) -> None:
    store.set_mark(StoredMark("b", "cordoned", 1.0, None))
    store.set_mark(StoredMark("a", "draining", 2.0, 302.0))
    store.set_mark(StoredMark("b", "draining", 3.0, None))  # replaces b's
    assert store.marks() == [
        StoredMark("a", "draining", 2.0, 302.0),
        StoredMark("b", "draining", 3.0, None),
    ]
    store.clear_mark("a")
    store.clear_mark("nobody")
    assert [m.node for m in store.marks()] == ["b"]
    assert store.get_meta("epoch") is None
    store.set_meta("epoch", "1")
    store.set_meta("epoch", "2")
    assert store.get_meta("epoch") == "2"


def test_a_meta_value_put_once_keeps_the_first(store: Store, opened: Opened) -> None:
    """How control planes on one store agree on one fleet CA: the first put wins, fenced or
    not, and every later one gets it back."""
    assert store.put_meta_once("fleet_ca", "first") == "first"
    other = opened.open()
    try:
        other.fence(5)  # not the lease's epoch: fenced writes would be refused
        assert other.put_meta_once("fleet_ca", "second") == "first"
    finally:
        other.close()
    assert store.get_meta("fleet_ca") == "first"


def test_keys_tokens_and_credentials(store: Store) -> None:
    key = StoredKey("team-a", "a" * 64, "sk-abc", ("m1", "m2"), 60, None, 4, 1.0, None)
    store.put_key(key)
    store.put_key(StoredKey("all", "b" * 64, "sk-def", None, None, 1000, None, 2.0, 99.0))
    assert store.api_keys() == [
        StoredKey("all", "b" * 64, "sk-def", None, None, 1000, None, 2.0, 99.0),
        key,
    ]
    store.put_key(StoredKey("team-a", "c" * 64, "sk-ghi", (), 1, 2, 3, 1.0, 5.0))  # replaced
    assert store.api_keys()[1] == StoredKey("team-a", "c" * 64, "sk-ghi", (), 1, 2, 3, 1.0, 5.0)
    store.delete_key("all")
    assert [k.name for k in store.api_keys()] == ["team-a"]

    token = StoredJoinToken("t1", "d" * 64, 10.0, 3610.0, 2)
    store.put_join_token(token)
    store.put_join_token(StoredJoinToken("t0", "e" * 64, 5.0, None, None, 0, ("10.0.1.7",)))
    assert [t.id for t in store.join_tokens()] == ["t0", "t1"]  # oldest first
    assert [t.addresses for t in store.join_tokens()] == [("10.0.1.7",), ()]
    used = StoredJoinToken("t1", "d" * 64, 10.0, 3610.0, 1, used=1)
    store.record_join(used, StoredCredential("gpu-1", "f" * 64, 11.0, "t1"))
    assert store.join_tokens()[1] == used
    anew = StoredCredential("gpu-1", "0" * 64, 12.0, "t1", ("10.0.0.2",))  # a new one
    store.record_join(used, anew)
    assert store.credentials() == [anew]
    assert store.revoked_nodes() == {}
    store.revoke_node("gpu-1", 13.0)
    store.revoke_node("gpu-9", 14.0)  # a name that holds no credential (deleted)
    store.revoke_node("gpu-1", 15.0)  # revoked again, once joined anew: the last time counts
    store.delete_join_token("t0")
    assert store.credentials() == [] and [t.id for t in store.join_tokens()] == ["t1"]
    assert store.revoked_nodes() == {"gpu-1": 15.0, "gpu-9": 14.0}


def test_a_change_made_with_a_request_id_is_made_once_and_says_so(store: Store) -> None:
    """Issue 57: the request id of a change is recorded in the change's own transaction, so
    whether it landed has one answer, the store's; a second write with the same id is
    refused (AlreadyMade, naming what the first did) and changes nothing."""
    once = Once("req-1", "PUT /v1/catalog", {"note": "x"})
    assert store.request("req-1") is None
    version = store.add_catalog("d1", 1.0, "api", {"models": []}, "models: []\n", once)
    made = store.request("req-1")
    assert made is not None and made.route == "PUT /v1/catalog"
    assert made.outcome == {"note": "x", "version": version, "digest": "d1"}
    with pytest.raises(AlreadyMade) as again:
        store.add_catalog("d2", 2.0, "api", {"models": []}, "models: []\n", once)
    assert again.value.request.outcome["version"] == version
    assert [c.version for c in store.catalog_history(10)] == [version]  # not made twice
    assert store.write_problem() is None  # a refusal as it should be: no failing store

    key = StoredKey("k", "a" * 64, "sk-abc", None, None, None, None, 1.0, None)
    store.put_key(key, Once("req-2", "POST /v1/keys", {}))
    with pytest.raises(AlreadyMade):
        store.put_key(dataclasses.replace(key, sha256="b" * 64), Once("req-2", "POST /v1/keys", {}))
    assert store.api_keys() == [key]
    with pytest.raises(AlreadyMade):  # an id is one change, whichever
        store.delete_key("k", Once("req-1", "DELETE /v1/keys/k", {}))
    assert store.api_keys() == [key]
    store.set_mark(StoredMark("gpu-1", "cordoned", 3.0, None), Once("req-3", "mark", {}))
    with pytest.raises(AlreadyMade):
        store.clear_mark("gpu-1", Once("req-3", "mark", {}))
    assert [m.node for m in store.marks()] == ["gpu-1"]


def test_a_postgres_transaction_cut_as_it_commits_is_of_unknown_outcome(pg: PgServer) -> None:
    """Issue 57: a transaction whose connection broke while it committed may or may not have
    been made: OutcomeUnknown ("may have been made"), never "nothing was changed"; one whose
    connection broke before its COMMIT was sent was rolled back by the server: a plain
    StoreUnreachable."""
    store = PostgresStore(fresh_database(pg))
    other = psycopg.connect(pg.conninfo(), autocommit=True)
    try:
        txn = store._transaction  # type: ignore[attr-defined]
        with pytest.raises(OutcomeUnknown), txn() as tx:
            tx.execute("INSERT INTO meta (key, value) VALUES ('a', '1')")
            [(pid,)] = tx.execute("SELECT pg_backend_pid()").fetchall()
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(StoreUnreachable) as before, txn() as tx:
            [(pid,)] = tx.execute("SELECT pg_backend_pid()").fetchall()
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
            tx.execute("INSERT INTO meta (key, value) VALUES ('b', '1')")
        assert not isinstance(before.value, OutcomeUnknown)
        assert store.get_meta("b") is None
    finally:
        other.close()
        store.close()


def event(reason: str, regarding: str, at: float) -> StoredEvent:
    return StoredEvent(0, "normal", reason, regarding, f"{reason} {regarding}", 1, at, at, "cp")


def test_events_are_kept_by_count_and_read_by_object_kind_time_and_id(store: Store) -> None:
    ids = store.write_events(
        [EventWrite(event("NodeMarked", "node/a", 10.0)),
         EventWrite(event("NodeMarked", "node/b", 20.0))],
        keep=4,
    )  # fmt: skip
    ids += store.write_events(
        [EventWrite(event("ReplicaPlaced", "replica/m-1", 30.0)),
         EventWrite(event("NodeMarked", "node/ab", 40.0))],
        keep=4,
    )  # fmt: skip
    assert ids == sorted(ids) and len(set(ids)) == 4
    again = dataclasses.replace(event("NodeMarked", "node/a", 10.0), count=3, last_at=50.0)
    assert store.write_events([EventWrite(again, ids[0])], keep=4) == [ids[0]]
    [first] = store.events("node/a")
    assert (first.count, first.first_at, first.last_at) == (3, 10.0, 50.0)
    # In the order they were last seen (issue 57: by first seen, a repeat stayed far back).
    assert [e.regarding for e in store.events("node")] == ["node/b", "node/ab", "node/a"]
    assert [e.regarding for e in store.events("replica")] == ["replica/m-1"]
    assert [e.id for e in store.events(since=25.0)] == [ids[2], ids[3], ids[0]]
    assert [e.id for e in store.events(after=ids[1])] == ids[2:]
    # The last seen, oldest first.
    assert [e.id for e in store.events(limit=2)] == [ids[3], ids[0]]
    store.write_events([EventWrite(event("NodeMarked", "node/c", 60.0))], keep=4)  # oldest goes
    assert [e.regarding for e in store.events()] == ["node/b", "replica/m-1", "node/ab", "node/c"]


def test_a_scope_reads_a_models_replicas_and_a_nodes_shards_exactly(store: Store) -> None:
    """What `ctl events --for model/NAME` and a node's page read (issue 57): a model's events
    with its replicas' (not those of a model whose name begins the same), a node's with the
    events of shards on it (not on a node whose name begins the same, nor differs in case)."""
    made = [
        ("ReplicaPending", "model/chat", "1 replica(s) cannot be placed now"),
        ("ReplicaPlaced", "replica/chat-0a1b2c", "chat on n_1[0]: 1 wanted"),
        ("ShardFailed", "replica/chat-0a1b2c", "shard 0 on n_1: engine exited (1)"),
        ("ShardStarted", "replica/chat-0a1b2c", "shard 1 on n_1"),
        ("ShardReady", "replica/chat-2-0a1b2c", "shard 0 on n_10 ready in 1.0s"),
        ("ShardReady", "replica/chat-9f9f9f", "shard 0 on N_1 ready in 1.0s"),
        ("ShardReady", "replica/chat-9f9f9f", "shard 0 on nx1 ready in 1.0s"),
        ("NodeMarked", "node/n_1", "marked cordoned (was none)"),
        ("NodeMarked", "node/n_10", "marked cordoned (was none)"),
    ]
    store.write_events(
        [EventWrite(StoredEvent(0, "normal", r, g, m, 1, n, n, "cp"))
         for n, (r, g, m) in enumerate(made)],
        keep=100,
    )  # fmt: skip
    model = EventScope(("model/chat",), families=("replica/chat-",))
    assert [(e.reason, e.regarding) for e in store.events(model)] == [
        ("ReplicaPending", "model/chat"),
        ("ReplicaPlaced", "replica/chat-0a1b2c"),
        ("ShardFailed", "replica/chat-0a1b2c"),
        ("ShardStarted", "replica/chat-0a1b2c"),
        ("ShardReady", "replica/chat-9f9f9f"),
        ("ShardReady", "replica/chat-9f9f9f"),
    ]
    node = EventScope(("node/n_1",), shards_on="n_1")
    assert [(e.reason, e.message) for e in store.events(node)] == [
        ("ShardFailed", "shard 0 on n_1: engine exited (1)"),
        ("ShardStarted", "shard 1 on n_1"),
        ("NodeMarked", "marked cordoned (was none)"),
    ]
    assert store.events(EventScope()) == []


def test_a_batch_of_events_larger_than_one_statement_gets_each_its_own_id(store: Store) -> None:
    first = store.write_events(
        [EventWrite(event("NodeMarked", f"node/{i}", 1.0)) for i in range(3)], keep=10_000
    )
    many = EVENT_ROWS_PER_STATEMENT * 2 + 7
    writes = [EventWrite(event("ReplicaPlaced", f"replica/m-{i}", 2.0)) for i in range(many)]
    again = dataclasses.replace(event("NodeMarked", "node/1", 1.0), count=5, last_at=3.0)
    writes.insert(many // 2, EventWrite(again, first[1]))  # a count among the new ones
    ids = store.write_events(writes, keep=10_000)
    assert len(ids) == len(writes) and ids[many // 2] == first[1]
    by_id = {e.id: e for e in store.events(limit=10_000)}
    assert len(by_id) == many + 3
    assert [by_id[i].regarding for i in ids] == [w.event.regarding for w in writes]
    assert (by_id[first[1]].count, by_id[first[1]].last_at) == (5, 3.0)


def test_usage_is_added_once_per_batch_and_summed(store: Store) -> None:
    hour = 3600 * 100
    rows = [StoredUsage("k", "m", hour, 2, 10, 20, 0, hour + 5.0)]
    assert store.add_usage("run-1", 1, rows, now=hour + 10.0)
    assert not store.add_usage("run-1", 1, rows, now=hour + 11.0)  # sent again: once
    more = [
        StoredUsage("k", "m", hour, 1, 1, 2, 1, hour + 9.0),
        StoredUsage("k", "other", hour + 3600, 5, 5, 5, 0, hour + 3700.0),
        StoredUsage("j", "m", hour, 1, 1, 1, 0, hour + 1.0),
    ]
    assert store.add_usage("run-2", 1, more, now=hour + 20.0)
    assert store.usage(key="k", model="m") == [
        StoredUsage("k", "m", hour, 3, 11, 22, 1, hour + 9.0)
    ]
    assert [(u.key, u.model) for u in store.usage()] == [("j", "m"), ("k", "m"), ("k", "other")]
    assert [u.model for u in store.usage(since=hour + 1)] == ["other"]
    assert store.usage_totals() == {"k": (8, 43, hour + 3700.0), "j": (1, 2, hour + 1.0)}


def test_points_are_replaced_in_place_read_by_step_and_forgotten_by_age(store: Store) -> None:
    def point(kind: str, subject: str, step: int, at: int, body: str = "{}") -> StoredPoint:
        return StoredPoint(kind, subject, step, at, body)

    store.put_points(
        [point("model", "m", 60, 60), point("model", "m", 60, 120), point("node", "n-1", 60, 60),
         point("model", "m", 900, 0, '{"a": 1}')],
        forget={},
    )  # fmt: skip
    store.put_points([point("model", "m", 900, 0, '{"a": 2}')], forget={})  # the same point
    assert store.points("model", "m", 900, 0) == [point("model", "m", 900, 0, '{"a": 2}')]
    assert [p.at for p in store.points("model", "m", 60, 0)] == [60, 120]
    assert [p.at for p in store.points("model", "m", 60, 100)] == [120]
    assert {(p.kind, p.subject) for p in store.points(None, None, 60, 0)} == {
        ("model", "m"),
        ("node", "n-1"),
    }
    # Many at once (more than one statement's rows), and the old of one step forgotten.
    many = [point("key", f"k{i}", 60, 180) for i in range(2500)]
    store.put_points(many, forget={60: 120})
    assert len(store.points("key", None, 60, 0)) == 2500
    assert [p.at for p in store.points("model", "m", 60, 0)] == [120]
    assert store.points("node", "n-1", 60, 0) == []
    assert len(store.points("model", "m", 900, 0)) == 1  # another step: kept


def test_a_schema_newer_than_this_modelfleet_is_refused_naming_both(opened: Opened) -> None:
    opened.open().close()
    if opened.kind == "sqlite":
        with sqlite3.connect(opened.where) as db:
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    else:
        with psycopg.connect(opened.where, autocommit=True) as conn:
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError) as refused:
        opened.open()
    said = str(refused.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in said
    assert f"up to {SCHEMA_VERSION}" in said


def test_control_planes_opening_a_new_postgres_store_together_migrate_it_once(
    pg: PgServer,
) -> None:
    where = fresh_database(pg)
    opened: list[Store] = []
    failed: list[BaseException] = []

    def open_one() -> None:
        try:
            opened.append(PostgresStore(where))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failed == [] and len(opened) == 4
    with psycopg.connect(where) as conn:
        versions = conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]
    for s in opened:
        s.close()


def test_a_postgres_store_whose_server_stops_refuses_writes_then_recovers(pg: PgServer) -> None:
    """A write while the server is down changes nothing and says so (without the password);
    once it is back the pool connects anew (after its reconnect backoff) and writing works,
    the problem cleared."""
    store = PostgresStore(fresh_database(pg), bounds=Bounds.for_lease(1.0))
    store.set_meta("before", "1")
    pg.stop("immediate")
    try:
        with pytest.raises(StoreError) as refused:
            store.set_meta("during", "1")
        said = str(refused.value)
        assert "cannot write the store postgresql://modelfleet:***@127.0.0.1" in said, said
        assert pg.password_file.read_text().strip() not in said
        problem = store.write_problem()
        assert problem is not None and "1 write(s) failed" in problem
    finally:
        pg.start()

    def written() -> bool:
        try:
            store.set_meta("after", "1")
        except StoreError:
            return False  # the pool's reconnect is still backing off
        return True

    wait_for("a write to go through once the server is back", written, timeout=30)
    assert store.write_problem() is None
    assert (store.get_meta("before"), store.get_meta("during"), store.get_meta("after")) == (
        "1",
        None,
        "1",
    )
    store.close()


def test_a_fleet_keeps_its_desired_state_in_postgres(pg: PgServer, tmp_path: Path) -> None:
    """A control plane given `store: postgresql://...` keeps its catalogs, marks and events
    there, not in its state dir: a new control plane on another state dir finds them."""
    from .conftest import Operator, fleet_of

    where = fresh_database(pg)
    model = {"name": "m", "engine": "sim"}
    with fleet_of(tmp_path, [model], control_plane={"store": where}) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("m serving", lambda: op.serves("m"))
        op.ctl("cordon", "node-2")
        assert not list((tmp_path / "state").rglob("store.sqlite"))
    with psycopg.connect(where) as conn:
        catalogs = conn.execute("SELECT version, source FROM catalogs").fetchall()
        marks = conn.execute("SELECT node, mark FROM node_marks").fetchall()
        reasons = {r for (r,) in conn.execute("SELECT reason FROM events").fetchall()}
    assert len(catalogs) == 1 and marks == [("node-2", "cordoned")]
    assert {"ControlPlaneStarted", "CatalogApplied", "NodeMarked", "ShardReady"} <= reasons


def test_the_lease_is_taken_renewed_run_out_and_fences_the_holder_before(
    store: Store, opened: Opened
) -> None:
    """By the store's own clock: taken when free, renewed by its holder, left to its holder
    while it runs; once it ran out another takes it under the next epoch, and every write
    of the one before, fenced to its epoch, is refused."""
    from modelfleet.store import Fenced

    a = store.take_lease("cp-a", 0.5)
    assert (a.holder, a.epoch) == ("cp-a", 1) and 0.3 < a.remaining_s <= 0.5
    other = opened.open()  # a second control plane on the same store
    try:
        assert other.take_lease("cp-b", 0.5).holder == "cp-a"  # held: left as it is
        renewed = store.take_lease("cp-a", 0.5)
        assert (renewed.holder, renewed.epoch) == ("cp-a", 1)
        store.fence(1)
        store.set_meta("written-by", "cp-a")
        wait_for("the lease to run out", lambda: other.lease().remaining_s <= 0, timeout=5)
        b = other.take_lease("cp-b", 5.0)
        assert (b.holder, b.epoch) == ("cp-b", 2)
        other.fence(2)
        with pytest.raises(Fenced) as refused:
            store.set_meta("written-by", "cp-a, late")
        assert "epoch 1" in str(refused.value) and "epoch 2, held by cp-b" in str(refused.value)
        other.set_meta("written-by", "cp-b")
        assert store.get_meta("written-by") == "cp-b"
        store.release_lease("cp-a")  # not its holder: nothing happens
        assert other.lease().holder == "cp-b" and other.lease().remaining_s > 1
        other.release_lease("cp-b")  # an orderly stop: the next may take it at once
        c = store.take_lease("cp-a", 5.0)
        assert (c.holder, c.epoch) == ("cp-a", 3)
    finally:
        other.close()


def test_a_peer_frozen_inside_a_fenced_write_delays_a_takeover_by_the_bounds_only(
    pg: PgServer,
) -> None:
    """A leader frozen (SIGSTOP) in the middle of a fenced write holds the lease row shared.
    Another control plane's take waits for that lock no longer than lock_timeout and tries
    again; the server ends the frozen session idle_in_transaction_session_timeout after its
    last word, and the take goes through: the frozen leader's write, once it thaws, is
    refused. Without the bounds the take waited for as long as the leader was frozen."""
    where, ttl = fresh_database(pg), 1.0
    bounds = Bounds.for_lease(ttl)
    a, b = PostgresStore(where, bounds=bounds), PostgresStore(where, bounds=bounds)
    try:
        assert a.take_lease("cp-a", ttl).epoch == 1
        a.fence(1)
        inside, thaw = threading.Event(), threading.Event()
        outcome: list[BaseException | None] = []

        def frozen() -> None:
            try:
                with a._write() as tx:  # fenced: the lease row is held shared from here
                    tx.execute("UPDATE meta SET value = value WHERE key = 'none'")
                    inside.set()
                    thaw.wait(60)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=frozen)
        thread.start()
        assert inside.wait(10), "the frozen write never began"
        began, bound = time.monotonic(), ttl + bounds.idle_in_transaction + 2 * bounds.lock
        taken = None
        while taken is None:
            try:
                lease = b.take_lease("cp-b", ttl)
                taken = lease if lease.holder == "cp-b" else None
            except StoreError as exc:  # lock_timeout: tried again, as the lease loop does
                assert "lock timeout" in str(exc), exc
            assert time.monotonic() - began < bound + 1, "the takeover waited past its bounds"
            if taken is None:
                time.sleep(ttl / 3)
        assert taken.epoch == 2
        thaw.set()
        thread.join(30)
        assert outcome and isinstance(outcome[0], StoreError), outcome
        assert b.get_meta("none") is None
    finally:
        a.close()
        b.close()


def test_a_store_of_schema_1_takes_the_tables_of_later_versions_at_open(opened: Opened) -> None:
    opened.open().close()
    if opened.kind == "sqlite":
        with sqlite3.connect(opened.where) as db:
            db.execute("DROP TABLE lease")
            db.execute("DROP TABLE control_planes")
            db.execute("DROP TABLE series")
            db.execute("PRAGMA user_version = 1")
    else:
        with psycopg.connect(opened.where, autocommit=True) as conn:
            conn.execute("DROP TABLE lease")
            conn.execute("DROP TABLE control_planes")
            conn.execute("DROP TABLE series")
            conn.execute("DELETE FROM schema_version WHERE version > 1")
    store = opened.open()
    try:
        assert store.lease().holder == "" and store.take_lease("cp", 1.0).epoch == 1
        assert store.control_planes() == []
        assert store.points(None, None, 60, 0) == []
    finally:
        store.close()


def test_control_planes_say_where_they_are_and_when_they_were_seen(
    store: Store, opened: Opened
) -> None:
    """By the store's clock, whoever leads: a fenced store (a leader that lost its lease)
    still says it is alive."""
    store.see_control_plane("cp-a", "https://a:7070", "https://a:7071")
    other = opened.open()
    try:
        other.see_control_plane("cp-b", "https://b:7070", "https://b:7071")
        store.take_lease("cp-a", 5.0)
        store.fence(7)  # not the lease's epoch: every fenced write is refused
        store.see_control_plane("cp-a", "https://a2:7070", "https://a2:7071")
        seen = other.control_planes()
        assert [(p.name, p.agent_url, p.admin_url) for p in seen] == [
            ("cp-a", "https://a2:7070", "https://a2:7071"),
            ("cp-b", "https://b:7070", "https://b:7071"),
        ]
        assert all(0 <= p.seen_ago_s < 5 for p in seen), seen
    finally:
        other.close()


def start_control_plane(
    procs: Procs, tmp_path: Path, name: str, token: str, config: dict[str, Any] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, str], Any]:
    """Control plane `name`, of `config` written to cp-NAME.yaml (or of the one written
    before), started under `procs` and ready: its process, its URLs and an httpx client of
    its admin API."""
    import httpx
    import yaml

    from .conftest import wait_json

    if config is not None:
        (tmp_path / f"cp-{name}.yaml").write_text(yaml.safe_dump(config))
    ready = tmp_path / f"cp-{name}.json"
    ready.unlink(missing_ok=True)
    proc = procs.start("control-plane", "--config", str(tmp_path / f"cp-{name}.yaml"),
                       "--ready-file", str(ready), log=f"cp-{name}")  # fmt: skip
    urls = wait_json(ready, proc)["urls"]
    admin = httpx.Client(
        base_url=urls["admin"], headers={"authorization": f"Bearer {token}"}, timeout=10
    )
    return proc, urls, admin


def test_two_control_planes_on_one_store_one_leads_and_the_other_takes_over(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """A second control plane on the fleet's PostgreSQL store follows: it plans nothing and
    redirects agents and changes to the leader (307), and its status lists both control
    planes. Killed -9, the leader's lease runs out and
    the follower takes it under the next epoch, within the TTL and a renewal; the router
    keeps serving from the table it holds meanwhile (the new leader, having heard from no
    node, publishes none)."""
    import os
    import signal
    import time

    import httpx
    import yaml

    from .conftest import Operator, fleet_of, wait_json

    where = fresh_database(pg)
    cp = {"store": where, "lease_ttl": 1.5}
    with fleet_of(tmp_path, [{"name": "m", "engine": "sim"}], control_plane=cp) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("m serving", lambda: op.serves("m"))
        config = tmp_path / "cp-b.yaml"
        config.write_text(
            yaml.safe_dump(
                {"state_dir": str(tmp_path / "cp-b"), "agent_port": 0, "admin_port": 0,
                 "admin_token": fleet.admin_token, "agent_token": fleet.agent_token, **cp}
            )
        )  # fmt: skip
        ready = tmp_path / "cp-b.json"
        proc = procs.start("control-plane", "--config", str(config), "--ready-file", str(ready),
                           log="cp-b")  # fmt: skip
        urls = wait_json(ready, proc)["urls"]
        b = httpx.Client(
            base_url=urls["admin"],
            headers={"authorization": f"Bearer {fleet.admin_token}"},
            timeout=10,
        )
        status = b.get("/v1/status").json()
        assert not status["leading"] and status["lease_epoch"] == 1
        assert status["leader"] and status["store"].startswith("postgresql://modelfleet:***@")
        planes = {p["admin_url"]: p for p in status["control_planes"]}
        assert set(planes) == {urls["admin"], fleet.admin_url}, planes
        assert planes[fleet.admin_url]["leads"] and planes[urls["admin"]]["answering"]
        assert all(p["seen_ago_s"] < 5 for p in planes.values()), planes
        redirected = b.post("/v1/nodes/node-1/mark?x=1", json={"mark": "cordoned"})
        assert redirected.status_code == 307 and "follows" in redirected.text
        assert redirected.headers["location"] == f"{fleet.admin_url}/v1/nodes/node-1/mark?x=1"
        report = httpx.post(
            f"{urls['agent']}/v1/report",
            headers={"authorization": f"Bearer {fleet.agent_token}"},
            content=b"{}",
            timeout=10,
        )
        assert report.status_code == 307 and "follows" in report.text
        assert report.headers["location"] == f"{fleet.agent_urls[0]}/v1/report"
        assert b.get("/v1/status").json()["reconcile_passes"] == 0
        # ctl given every admin API (one not even there): it reaches one that answers, and a
        # change the follower redirects goes to the leader.
        every = f"http://127.0.0.1:9,{urls['admin']}"
        ctl = [sys.executable, "-m", "modelfleet", "ctl", "--admin", every,
               "--token", fleet.admin_token]  # fmt: skip
        shown = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0 and "follows" in shown.stdout, shown.stderr
        assert "CONTROL PLANE" in shown.stdout and "(this one)" in shown.stdout, shown.stdout
        cordoned = subprocess.run(
            [*ctl, "cordon", "node-2"], capture_output=True, text=True, timeout=30
        )
        assert cordoned.returncode == 0, cordoned.stderr
        marks = {n["name"]: n["mark"] for n in op.get("/v1/nodes")["nodes"]}
        assert marks["node-2"] == "cordoned"

        # Changes the leader makes after the follower read the store: the follower reads them
        # again when it takes over.
        made = op.admin.post("/v1/keys", json={"name": "late"})
        assert made.status_code == 200, made.text
        models = {"models": [{"name": "m", "engine": "sim"}, {"name": "n", "engine": "sim"}]}
        applied = op.admin.put("/v1/catalog", content=yaml.safe_dump(models))
        assert applied.status_code == 200, applied.text
        version = applied.json()["version"]

        [leader] = [c for c in fleet.fleet.children if c.role == "control-plane"]
        os.kill(leader.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        leader.proc.wait()
        wait_for("the follower leading", lambda: b.get("/v1/status").json()["leading"], 15)
        took = time.monotonic() - killed
        print(f"took over {took:.2f}s after the kill (lease TTL 1.5 s)")
        status = b.get("/v1/status").json()
        assert status["lease_epoch"] == 2
        events = b.get("/v1/events", params={"for": "control-plane"}).json()["events"]
        elected = [e for e in events if e["reason"] == "LeaderElected"]
        assert elected and "ran out" in elected[-1]["message"], events
        assert op.serves("m")  # the router serves from the table it holds
        assert [k["name"] for k in b.get("/v1/keys").json()["keys"]] == ["late"]
        assert b.get("/v1/catalog").json()["version"] == version


def test_an_agent_that_knows_both_control_planes_follows_the_leader_through_a_failover(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """Two control planes on one PostgreSQL store, and an agent given both URLs. It reports
    to the leader (asked who leads, the follower names it). The leader killed -9, the other
    takes the lease; the agent finds it, and the new leader adopts the running engine (same
    pid: nothing restarted) and acts on a catalog change. The agent took answers of epoch 1,
    then 2."""
    import os
    import signal

    import httpx
    import yaml

    from modelfleet.agent.records import recorded_engine_pids
    from modelfleet.host.processes import free_port, stop_groups

    where = fresh_database(pg)
    token, agent_token = "admin-token-of-the-test", "agent-token-of-the-test"
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(yaml.safe_dump({"models": [{"name": "m", "engine": "sim"}]}))
    admins: dict[str, httpx.Client] = {}
    agent_urls: list[str] = []
    started: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("a", "b"):
        port = free_port("127.0.0.1")
        config = {
            "state_dir": str(tmp_path / f"cp-{name}"), "agent_port": port, "admin_port": 0,
            "admin_token": token, "agent_token": agent_token, "store": where,
            "lease_ttl": 1.5, "settle_for": 2,
            **({"catalog": str(catalog)} if name == "a" else {}),
        }  # fmt: skip
        started[name], urls, admins[name] = start_control_plane(
            procs, tmp_path, name, token, config
        )
        agent_urls.append(urls["agent"])
    a, b = admins["a"], admins["b"]
    assert a.get("/v1/status").json()["leading"] and not b.get("/v1/status").json()["leading"]
    agent_dir = tmp_path / "agent"
    # B first: the follower redirects the agent to the leader.
    procs.start(
        "agent", "--control-plane", f"{agent_urls[1]},{agent_urls[0]}", "--node", "n1",
        "--simulate-gpus", "2x80GB", "--token", agent_token, "--state-dir", str(agent_dir),
        "--report-interval", "0.5", log="agent",
    )  # fmt: skip
    try:

        def ready_on(client: httpx.Client, count: int) -> list[dict[str, object]] | None:
            reps = client.get("/v1/replicas").json()["replicas"]
            ready = [r for r in reps if r["state"] == "ready"]
            return ready if len(ready) == count else None

        [before] = wait_for("m ready on the leader", lambda: ready_on(a, 1), 60)
        said = procs.log("agent")
        assert f"the leader is at {agent_urls[0]}: talking to it now" in said, said[-2000:]
        assert "answers under epoch 1" in said
        leader = started["a"]
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        wait_for("b leading", lambda: b.get("/v1/status").json()["leading"], 15)
        [after] = wait_for("m adopted by the new leader", lambda: ready_on(b, 1), 60)
        assert after["id"] == before["id"]
        assert after["shards"][0]["pid"] == before["shards"][0]["pid"]  # nothing restarted
        scaled = {"models": [{"name": "m", "engine": "sim", "replicas": 2}]}
        assert b.put("/v1/catalog", content=yaml.safe_dump(scaled)).status_code == 200
        wait_for("a second replica placed by the new leader", lambda: ready_on(b, 2), 60)
        said = procs.log("agent")
        assert f"the leader at {agent_urls[1]} answers under epoch 2" in said, said[-2000:]
        assert "refused an assignment" not in said
    finally:
        procs.stop_all()
        stop_groups(recorded_engine_pids(agent_dir), grace=10)


def test_agents_and_ctl_go_straight_to_the_leader_past_a_frozen_control_plane(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """Issue 57: agents bounced between stale control planes and never tried the one holding
    the lease; with the first control plane of ctl's list frozen (SIGSTOP), every change
    failed with "may have been made" though a healthy leader existed. Both ask every control
    plane who leads and go straight to the leader: the frozen one, listed first, is sent
    neither a report nor the change."""
    import os
    import signal

    from modelfleet.agent.records import recorded_engine_pids
    from modelfleet.host.processes import stop_groups

    where = fresh_database(pg)
    token, agent_token = "admin-token-of-the-test", "agent-token-of-the-test"
    urls: dict[str, dict[str, str]] = {}
    started: dict[str, subprocess.Popen[bytes]] = {}
    admins: dict[str, Any] = {}
    for name in ("a", "b"):
        config = {
            "state_dir": str(tmp_path / f"cp-{name}"), "agent_port": 0, "admin_port": 0,
            "admin_token": token, "agent_token": agent_token, "store": where,
            "lease_ttl": 1.5, "settle_for": 2,
        }  # fmt: skip
        started[name], urls[name], admins[name] = start_control_plane(
            procs, tmp_path, name, token, config
        )
    assert admins["a"].get("/v1/status").json()["leading"]
    wait_for("b sees where a is", lambda: any(
        p["leads"] and p["admin_url"] == urls["a"]["admin"]
        for p in admins["b"].get("/v1/status").json()["control_planes"]))  # fmt: skip
    agent_dir = tmp_path / "agent"
    os.kill(started["b"].pid, signal.SIGSTOP)  # the first of every list
    try:
        procs.start(
            "agent", "--control-plane", f"{urls['b']['agent']},{urls['a']['agent']}",
            "--node", "n1", "--simulate-gpus", "1x80GB", "--token", agent_token,
            "--state-dir", str(agent_dir), "--report-interval", "0.5", log="agent",
        )  # fmt: skip

        def nodes() -> list[str]:
            return [n["name"] for n in admins["a"].get("/v1/nodes").json()["nodes"]]

        wait_for("n1 reporting to the leader", lambda: nodes() == ["n1"], 30)
        said = procs.log("agent")
        assert f"the leader is at {urls['a']['agent']}: talking to it now" in said, said[-2000:]
        assert f"report to {urls['b']['agent']}" not in said, said[-2000:]
        every = f"{urls['b']['admin']},{urls['a']['admin']}"
        cordoned = subprocess.run(
            [sys.executable, "-m", "modelfleet", "ctl", "--admin", every, "--token", token,
             "cordon", "n1"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cordoned.returncode == 0, cordoned.stderr
        marks = {n["name"]: n["mark"] for n in admins["a"].get("/v1/nodes").json()["nodes"]}
        assert marks == {"n1": "cordoned"}
    finally:
        os.kill(started["b"].pid, signal.SIGCONT)
        procs.stop_all()
        stop_groups(recorded_engine_pids(agent_dir), grace=10)


def test_a_catalog_applied_on_the_leader_stands_through_a_follower_restart_and_a_failover(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """Two control planes as on two hosts: each its own state dir and catalog file. A follower
    that restarted once wrote its own file into the store, and after the next failover the
    fleet ran that old catalog. Now a follower writes nothing and answers what the store holds
    at the time of the read; taking the lead it keeps the API's catalog and makes its file
    show it."""
    import os
    import signal

    import httpx
    import yaml

    where, token = fresh_database(pg), "admin-token-of-the-test"

    def start(name: str) -> tuple[subprocess.Popen[bytes], httpx.Client]:
        proc, _, client = start_control_plane(procs, tmp_path, name, token)
        return proc, client

    for name in ("a", "b"):
        catalog = tmp_path / name / "catalog.yaml"
        catalog.parent.mkdir()
        catalog.write_text(f"# host {name}\nmodels:\n  - name: m\n    engine: sim\n")
        config = {"state_dir": str(tmp_path / name / "state"), "catalog": str(catalog),
                  "agent_port": 0, "admin_port": 0, "admin_token": token, "store": where,
                  "lease_ttl": 1.5}  # fmt: skip
        (tmp_path / f"cp-{name}.yaml").write_text(yaml.safe_dump(config))
    leader, a = start("a")
    assert a.get("/v1/status").json()["leading"]
    follower, b = start("b")
    assert not b.get("/v1/status").json()["leading"]
    two = {"models": [{"name": "m", "engine": "sim"}, {"name": "n", "engine": "sim"}]}
    applied = a.put("/v1/catalog", content=yaml.safe_dump(two))
    assert applied.status_code == 200, applied.text
    version = applied.json()["version"]
    assert a.post("/v1/keys", json={"name": "made-after-b-started"}).status_code == 200
    # The follower answers what the store holds now, not what it read at its start.
    assert [k["name"] for k in b.get("/v1/keys").json()["keys"]] == ["made-after-b-started"]
    assert b.get("/v1/catalog").json()["version"] == version

    follower.send_signal(signal.SIGTERM)
    follower.wait(30)
    follower, b = start("b")
    history = b.get("/v1/catalog/history").json()["versions"]
    assert [v["version"] for v in history] == [version, version - 1], history

    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    wait_for("b leading", lambda: b.get("/v1/status").json()["leading"], 15)
    shown = b.get("/v1/catalog").json()
    assert shown["version"] == version and [m["name"] for m in shown["models"]] == ["m", "n"]
    assert shown["source"] == "api"
    written = (tmp_path / "b" / "catalog.yaml").read_text()
    assert "name: n" in written and "catalog version" in written, written
    assert (tmp_path / "b" / "catalog.yaml.replaced").read_text().startswith("# host b")
    assert "what it held is in" in procs.log("cp-b")


def test_a_control_plane_outlasts_its_store_frozen_then_stopped_and_says_so(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue 38: PostgreSQL unreachable for about 20 s killed the leading control plane, and
    while it was down no admin API answered (store calls on the event loop). Now, the server
    frozen (SIGSTOP of it and its sessions), then stopped: the control plane stays up, `status`
    answers within a second and says since when the store is unreachable, a change is refused
    with 503 naming the store within a second, keys are listed from memory; once the server
    is back it leads again and changes land."""
    import os
    import signal

    import httpx
    import yaml

    from .conftest import wait_json

    folder = Path(tempfile.mkdtemp(prefix="modelfleet-pg-outage-"))
    server = PgServer(folder)
    server.start()
    token = "admin-token-of-the-test"
    try:
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(yaml.safe_dump({"models": [{"name": "m", "engine": "sim"}]}))
        config = {"state_dir": str(tmp_path / "state"), "catalog": str(catalog),
                  "agent_port": 0, "admin_port": 0, "admin_token": token,
                  "store": server.conninfo(), "lease_ttl": 1.5}  # fmt: skip
        (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
        proc = procs.start("control-plane", "--config", str(tmp_path / "cp.yaml"),
                           "--ready-file", str(tmp_path / "cp.json"), log="cp")  # fmt: skip
        admin = httpx.Client(
            base_url=wait_json(tmp_path / "cp.json", proc)["urls"]["admin"],
            headers={"authorization": f"Bearer {token}"},
            timeout=5,
        )
        assert admin.post("/v1/keys", json={"name": "before"}).status_code == 200

        def timed(method: str, path: str, **kwargs: Any) -> httpx.Response:
            began = time.monotonic()
            answer = admin.request(method, path, **kwargs)
            took = time.monotonic() - began
            assert took < 1.0, f"{method} {path} took {took:.2f}s during the outage"
            return answer

        def status() -> dict[str, Any]:
            answer: dict[str, Any] = timed("GET", "/v1/status").json()
            return answer

        def unreachable() -> bool:
            return "unreachable since" in (status().get("store_problem") or "")

        kept = ["before"]
        for outage in ("frozen", "stopped"):
            pids = server.pids()
            if outage == "frozen":
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
            else:
                server.stop("immediate")
            try:
                wait_for(f"status to say the store is unreachable ({outage})", unreachable, 15)
                refused = timed("POST", "/v1/keys", json={"name": f"during-{outage}"})
                assert refused.status_code == 503, refused.text
                assert "postgresql://modelfleet:***@127.0.0.1" in refused.json()["error"]
                listed = timed("GET", "/v1/keys").json()["keys"]
                assert [k["name"] for k in listed] == kept
                held = time.monotonic() + 6  # the lease runs out meanwhile, by any clock
                while time.monotonic() < held:
                    assert proc.poll() is None, procs.log("cp")[-3000:]
                    assert unreachable(), f"{outage}: {status()}\n{procs.log('cp')[-3000:]}"
                    time.sleep(0.5)
            finally:
                if outage == "frozen":
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                else:
                    server.start()
            wait_for(
                f"the control plane leading again after the store was {outage}",
                lambda: status()["leading"] and not status().get("store_problem"),
                30,
            )
            made = admin.post("/v1/keys", json={"name": f"after-{outage}"})
            assert made.status_code == 200, made.text
            kept = sorted([*kept, f"after-{outage}"])
        names = [k["name"] for k in admin.get("/v1/keys").json()["keys"]]
        assert names == ["after-frozen", "after-stopped", "before"]
        assert proc.poll() is None
        said = procs.log("cp")
        assert said.count("is unreachable: ") == 2, said[-3000:]  # once per outage
    finally:
        server.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


def test_a_leader_frozen_then_elected_again_adopts_what_runs_and_restarts_nothing(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """Issue 38's recipe: the leader frozen (SIGSTOP) past its lease, another takes over and
    adopts, that one killed -9, the first thawed: it wins the lease again, under a new
    epoch. It once acted on its old view: declared live nodes lost, restarted a replica the
    catalog had retired and stopped a healthy one. Now it begins a term from nothing: it
    settles until the nodes that held replicas report, adopts them, and restarts nothing."""
    import os
    import signal

    import httpx
    import yaml

    from modelfleet.agent.records import recorded_engine_pids
    from modelfleet.host.processes import stop_groups

    where, token, agent_token = fresh_database(pg), "admin-token-of-the-test", "a" * 20
    catalog = tmp_path / "catalog.yaml"
    model = {"name": "m", "engine": "sim", "replicas": 2}
    catalog.write_text(yaml.safe_dump({"models": [model]}))
    admins: dict[str, httpx.Client] = {}
    agent_urls: list[str] = []
    started: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("a", "b"):
        config = {"state_dir": str(tmp_path / f"cp-{name}"), "agent_port": 0, "admin_port": 0,
                  "admin_token": token, "agent_token": agent_token, "store": where,
                  "lease_ttl": 1.5, "catalog": str(catalog), "node_stale_after": 2,
                  "node_lost_after": 4, "node_forget_after": 600}  # fmt: skip
        started[name], urls, admins[name] = start_control_plane(
            procs, tmp_path, name, token, config
        )
        agent_urls.append(urls["agent"])
    a, b = admins["a"], admins["b"]
    nodes = ("n1", "n2")
    for node in nodes:
        procs.start(
            "agent", "--control-plane", ",".join(agent_urls), "--node", node,
            "--simulate-gpus", "1x80GB", "--token", agent_token, "--state-dir",
            str(tmp_path / node), "--report-interval", "0.5", log=node,
        )  # fmt: skip
    try:

        def ready_on(client: httpx.Client, count: int) -> dict[str, int] | None:
            try:
                reps = client.get("/v1/replicas").json()["replicas"]
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            ready = {r["id"]: r["shards"][0]["pid"] for r in reps if r["state"] == "ready"}
            everything = {r["id"] for r in reps}
            return ready if len(ready) == count == len(everything) else None

        before = wait_for("two replicas ready on a", lambda: ready_on(a, 2), 60)
        os.kill(started["a"].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            wait_for("b leading", lambda: b.get("/v1/status").json()["leading"], 20)
            # The agents left the frozen leader for b within about a lease TTL (1.5 s) and a
            # second: they once waited out a 12 s heartbeat timeout, b settled by its bound
            # meanwhile and kept an empty roster, and a placed anew when it led again.
            wait_for(
                "both agents to report to b",
                lambda: len([n for n in b.get("/v1/nodes").json()["nodes"] if n["ready"]]) == 2,
                6,
            )
            assert wait_for("b adopting both", lambda: ready_on(b, 2), 60) == before
            # While a is frozen the catalog changes: one replica retires. a's old view holds
            # two, and nodes last heard from longer ago than node_lost_after.
            one = yaml.safe_dump({"models": [{**model, "replicas": 1}]})
            applied = b.put("/v1/catalog", content=one)
            assert applied.status_code == 200, applied.text
            kept = wait_for("b retiring one replica", lambda: ready_on(b, 1), 60)
            wait_for(
                "a frozen past node_lost_after",
                lambda: time.monotonic() - frozen_at > 6 or None,
                10,
            )
        finally:
            os.kill(started["b"].pid, signal.SIGKILL)
            started["b"].wait()
            os.kill(started["a"].pid, signal.SIGCONT)
        status = wait_for(
            "a leading again, under a new epoch",
            lambda: (s := a.get("/v1/status").json())["leading"] and s["lease_epoch"] == 3 and s,
            20,
        )
        assert wait_for("a adopting the one kept", lambda: ready_on(a, 1), 60) == kept
        wait_for(
            "a's new term to plan once (and so to judge its nodes)",
            lambda: a.get("/v1/status").json()["reconcile_plans"] >= 1,
            30,
        )
        events = a.get("/v1/events", params={"limit": 1000}).json()["events"]
        elected = max(
            e["id"] for e in events
            if e["reason"] == "LeaderElected" and "epoch 3" in e["message"]
        )  # fmt: skip
        after = [e for e in events if e["id"] > elected]
        bad = {"NodeLost", "NodeStale", "ReplicaPlaced", "ReplicaRetiring", "ReplicaStopped"}
        assert not [e for e in after if e["reason"] in bad], after
        assert status["lease_epoch"] == 3
        for node in nodes:
            assert "refused an assignment" not in procs.log(node)
    finally:
        procs.stop_all()
        stop_groups([pid for n in nodes for pid in recorded_engine_pids(tmp_path / n)], 10)


def test_up_runs_three_control_planes_on_a_postgresql_of_its_own() -> None:
    """`up --control-planes 3 --store postgres`: a PostgreSQL in the state dir, three control
    planes on it, agents told every one. One leads; killed -9, another takes over, a change
    sent through ctl given every admin API lands, and stopping the fleet stops the server."""
    import os
    import signal

    import psutil

    from .conftest import fleet_of

    folder = Path(tempfile.mkdtemp(prefix="modelfleet-up-pg-"))
    os.chmod(folder, 0o711)  # run as root, the server runs as `postgres`, which must enter
    try:
        with fleet_of(
            folder,
            [{"name": "m", "engine": "sim"}],
            control_planes=3,
            store="postgres",
            control_plane={"lease_ttl": 1.5},
        ) as fleet:
            assert len(fleet.admin_urls) == 3 and fleet.store.startswith("postgresql://")
            ctl = [sys.executable, "-m", "modelfleet", "ctl", "--admin",
                   ",".join(fleet.admin_urls), "--token", fleet.admin_token]  # fmt: skip

            def status() -> dict[str, Any]:
                done = subprocess.run([*ctl, "-o", "json", "status"], capture_output=True,
                                      text=True, timeout=30)  # fmt: skip
                assert done.returncode == 0, done.stderr
                answer: dict[str, Any] = json.loads(done.stdout)
                return answer

            first = status()
            assert len(first["control_planes"]) == 3
            [leader] = [p for p in first["control_planes"] if p["leads"]]
            assert leader["admin_url"] == fleet.admin_urls[0]
            agent_args = fleet.fleet.children[-1].args
            assert ",".join(fleet.agent_urls) in agent_args, agent_args
            killed = next(c for c in fleet.fleet.children if c.label == "control-plane")
            os.kill(killed.proc.pid, signal.SIGKILL)
            killed.proc.wait()
            wait_for(
                "another control plane leading",
                lambda: status()["lease_epoch"] == first["lease_epoch"] + 1,
                30,
            )
            cordoned = subprocess.run([*ctl, "cordon", "node-2"], capture_output=True,
                                      text=True, timeout=30)  # fmt: skip
            assert cordoned.returncode == 0, cordoned.stderr
            nodes = subprocess.run([*ctl, "-o", "json", "nodes"], capture_output=True,
                                   text=True, timeout=30)  # fmt: skip
            marks = {n["name"]: n["mark"] for n in json.loads(nodes.stdout)["nodes"]}
            assert marks["node-2"] == "cordoned"
            server = next(c for c in fleet.fleet.children if c.role == "postgres")
            # The server paused by its pid (kill -STOP, as an operator or a debugger does)
            # and continued, then stopped: its exit is seen, for `up` to start it again. Run
            # as root under runuser, the wrapper stopped itself as su does when it saw the
            # server stopped, stayed stopped, and never reaped it.
            [pidfile] = folder.rglob("postmaster.pid")
            postmaster = int(pidfile.read_text().split()[0])
            head = psutil.Process(server.proc.pid)
            os.kill(postmaster, signal.SIGSTOP)
            wait_for("the server seen stopped", lambda: head.status() == psutil.STATUS_STOPPED, 10)
            os.kill(postmaster, signal.SIGCONT)
            os.kill(postmaster, signal.SIGINT)  # fast shutdown
            wait_for("the stopped server's exit", lambda: server.proc.poll() is not None, 30)
        assert server.proc.poll() is not None  # stopped with the fleet
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_control_planes_with_tls_on_one_store_share_the_fleet_ca(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    """The first control plane on a store puts its CA there; the next takes it, so a client
    that trusts the CA it was given checks either, and a change redirected by the follower
    reaches the leader over TLS. A state dir that holds another CA is refused, naming both."""
    import httpx
    import yaml

    from modelfleet.security.pki import client_context

    from .conftest import wait_json

    where = fresh_database(pg)
    token = "admin-token-of-the-test"

    def config(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "state_dir": str(tmp_path / name), "admin_token": token, "agent_token": "a" * 20,
            "tls": "on", "agent_port": 0, "admin_port": 0, "store": where, "lease_ttl": 1.5,
        }))  # fmt: skip
        return path

    ready: dict[str, dict[str, Any]] = {}
    for name in ("cp-a", "cp-b"):
        proc = procs.start("control-plane", "--config", str(config(name)), "--ready-file",
                           str(tmp_path / f"{name}.json"), log=name)  # fmt: skip
        ready[name] = wait_json(tmp_path / f"{name}.json", proc)
    assert ready["cp-a"]["ca_fingerprint"] == ready["cp-b"]["ca_fingerprint"]
    trusted = client_context(Path(ready["cp-a"]["ca_file"]).read_bytes())
    b = httpx.Client(
        base_url=ready["cp-b"]["urls"]["admin"],
        headers={"authorization": f"Bearer {token}"},
        verify=trusted,
        timeout=10,
    )
    assert not b.get("/v1/status").json()["leading"]
    made = b.post("/v1/keys", json={"name": "through-b"})
    assert made.status_code == 307, made.text
    assert made.headers["location"].startswith(ready["cp-a"]["urls"]["admin"])
    ctl = subprocess.run(
        [sys.executable, "-m", "modelfleet", "ctl", "--admin", ready["cp-b"]["urls"]["admin"],
         "--token", token, "--ca", ready["cp-a"]["ca_file"], "keys", "create", "through-b"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ctl.returncode == 0, ctl.stderr

    # A control plane whose state dir made a CA of its own, before it was given this store.
    alone = tmp_path / "cp-c.yaml"
    alone.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "cp-c"), "admin_token": token,
                                     "agent_token": "a" * 20, "agent_port": 0,
                                     "admin_port": 0}))  # fmt: skip
    first = procs.start("control-plane", "--config", str(alone), "--ready-file",
                        str(tmp_path / "cp-c.json"), log="cp-c-alone")  # fmt: skip
    own = wait_json(tmp_path / "cp-c.json", first)["ca_fingerprint"]
    first.terminate()
    first.wait(30)
    refused = subprocess.run(
        [sys.executable, "-m", "modelfleet", "control-plane", "--config", str(config("cp-c"))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0
    said = refused.stderr
    assert own in said and ready["cp-a"]["ca_fingerprint"] in said and "move" in said, said


def test_a_control_plane_started_while_its_store_is_down_waits_for_it(
    procs: Procs, tmp_path: Path
) -> None:
    """The nemesis started a control plane while PostgreSQL was frozen: it exited (code 2),
    and only a supervisor starting it again brought it back. Now it says once that it waits
    for its store, and starts as soon as the store answers."""
    import yaml

    from .conftest import wait_json

    folder = Path(tempfile.mkdtemp(prefix="modelfleet-pg-late-"))
    server = PgServer(folder)
    server.start()
    conninfo = server.conninfo()
    server.stop("immediate")
    try:
        config = {"state_dir": str(tmp_path / "state"), "agent_port": 0, "admin_port": 0,
                  "admin_token": "admin-token-of-the-test", "store": conninfo,
                  "catalog": str(tmp_path / "catalog.yaml")}  # fmt: skip
        (tmp_path / "catalog.yaml").write_text("models: []\n")
        (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
        ready = tmp_path / "cp.json"
        proc = procs.start("control-plane", "--config", str(tmp_path / "cp.yaml"),
                           "--ready-file", str(ready), log="cp")  # fmt: skip

        def said_or_gone() -> bool:
            return "waiting for it" in procs.log("cp") or proc.poll() is not None

        wait_for("the control plane to say it waits for its store", said_or_gone, 30)
        assert proc.poll() is None, procs.log("cp")[-3000:]
        assert not ready.exists()
        server.start()
        wait_json(ready, proc, timeout=60)
        said = procs.log("cp")
        assert said.count("waiting for it") == 1, said[-3000:]  # said once, not per try
    finally:
        server.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)
