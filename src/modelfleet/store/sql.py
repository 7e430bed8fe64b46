"""Every call of the `Store`, written once in SQL that SQLite and PostgreSQL both run.

`SqlStore` holds the calls; each implementation (`sqlite.py`, `postgres.py`) gives it two
things: a `Dialect` (the few places where the two speak differently: the clock, row locks, the
placeholder) and its transactions (`_transaction`, `_query`), which turn the database's own
errors into StoreError. So the lease, fencing, catalogs, keys, events and usage each have one
implementation, held to one contract by tests/integration/test_store.py on both databases.

The lease is one row (`id = 1`) timed by the database's own clock. Taking it locks the row
(PostgreSQL: `FOR UPDATE`; SQLite: the write lock of `BEGIN IMMEDIATE`), and every fenced
write first reads the row's epoch under a shared lock (`FOR SHARE`) in its own transaction: a
take waits for the writes of the epoch before it, and every write after a take sees the new
epoch and is refused (Fenced).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from modelfleet.store import (
    FAMILY_TAIL,
    REQUEST_MEMORY_S,
    AlreadyMade,
    EventScope,
    EventWrite,
    Fenced,
    Lease,
    Once,
    Rejection,
    SeenControlPlane,
    StoredCatalog,
    StoredCredential,
    StoredEvent,
    StoredJoinToken,
    StoredKey,
    StoredMark,
    StoredPoint,
    StoredRequest,
    StoredUsage,
    WriteHealth,
    fenced_message,
)

T = TypeVar("T")

# A batch seen longer ago than this is forgotten: no router resends one that old.
BATCH_MEMORY_S = 86400.0

# Rows per statement when events are written in bulk: 8 parameters each stays far below
# SQLite's limit of 32,766 parameters a statement.
EVENT_ROWS_PER_STATEMENT = 500
POINT_ROWS_PER_STATEMENT = 1000  # 5 parameters each


@dataclass(frozen=True)
class Dialect:
    """Where SQLite and PostgreSQL differ, for the calls `SqlStore` makes."""

    now: str  # the database's clock, in seconds since the epoch, as an SQL expression
    lock_row: str  # appended to a SELECT that will update the row it reads
    share_row: str  # appended to a SELECT whose row must not change until the commit
    lock_catalogs: str | None  # run before a catalog's version is taken as MAX + 1
    placeholder: str  # what the database's driver takes for a parameter: "?" or "%s"
    # The id of the last row this connection inserted, as an SQL expression, where one
    # INSERT numbers its rows one after another (SQLite, under its one write lock); None
    # where another writer's rows may come between them (PostgreSQL): there RETURNING id.
    last_id: str | None

    def sql(self, text: str) -> str:
        """`text`, written with `?` for each parameter, in this driver's placeholders."""
        return text if self.placeholder == "?" else text.replace("?", self.placeholder)


class Rows(Protocol):
    """What a statement gives back (a DB-API cursor)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Transaction(Protocol):
    """One open transaction: statements in `?` placeholders."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...


class SqlStore(ABC):
    """`Store` on a SQL database; subclasses connect and say how it differs (`dialect`)."""

    dialect: Dialect
    where: str
    health: WriteHealth
    fenced_epoch: int | None = None  # see `fence`

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Transaction]:
        """One transaction that writes, committed on leaving; any failure of the database is
        a StoreError and changed nothing."""

    @abstractmethod
    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """The rows of one read; a failure of the database is a StoreError."""

    @abstractmethod
    def close(self) -> None: ...

    @contextmanager
    def _write(self, fenced: bool = True) -> Iterator[Transaction]:
        """A write, fenced (see `fence`) unless `fenced` is False; its outcome recorded in
        `health` for `write_problem`."""
        epoch = self.fenced_epoch if fenced else None
        try:
            with self._transaction() as tx:
                if epoch is not None:
                    held, current = tx.execute(
                        f"SELECT holder, epoch FROM lease WHERE id = 1{self.dialect.share_row}"
                    ).fetchone()
                    if int(current) != epoch:
                        raise Fenced(fenced_message(epoch, int(current), held))
                yield tx
        except (Fenced, AlreadyMade):  # refused, as it should be: the store writes
            raise
        except Exception as exc:
            self.health.wrote(exc.__cause__ or exc)  # the database's own words
            raise
        self.health.wrote(None)

    def write_problem(self) -> str | None:
        return self.health.problem()

    def _once(self, tx: Transaction, once: Once | None, **learned: Any) -> None:
        """Record `once`'s request id in the transaction `tx` of its change, with its outcome
        and what the write `learned`; AlreadyMade (and the change rolled back) when the id
        was recorded before. Ids older than REQUEST_MEMORY_S are forgotten."""
        if once is None:
            return
        outcome = json.dumps({**once.outcome, **learned}, sort_keys=True)
        now = self.dialect.now
        added = tx.execute(
            f"INSERT INTO requests (id, route, outcome, at) VALUES (?, ?, ?, {now}) "
            "ON CONFLICT (id) DO NOTHING",
            (once.id, once.route, outcome),
        )
        if added.rowcount == 0:
            [(route, made, at)] = tx.execute(
                "SELECT route, outcome, at FROM requests WHERE id = ?", (once.id,)
            ).fetchall()
            raise AlreadyMade(StoredRequest(once.id, route, json.loads(made), float(at)))
        tx.execute(f"DELETE FROM requests WHERE at < {now} - ?", (REQUEST_MEMORY_S,))

    def request(self, request_id: str) -> StoredRequest | None:
        rows = self._query("SELECT route, outcome, at FROM requests WHERE id = ?", (request_id,))
        if not rows:
            return None
        [(route, outcome, at)] = rows
        return StoredRequest(request_id, route, json.loads(outcome), float(at))

    # -- the lease -------------------------------------------------------------------------

    def take_lease(
        self, holder: str, ttl_s: float, process: str = "", replacing: str = ""
    ) -> Lease:
        with self._write(fenced=False) as tx:
            held, epoch, expires_at, now, running = tx.execute(
                f"SELECT holder, epoch, expires_at, {self.dialect.now}, process FROM lease "
                f"WHERE id = 1{self.dialect.lock_row}"
            ).fetchone()
            epoch = int(epoch)
            # "" : a lease written before holders named their process.
            same = held == holder and running in (process, replacing, "")
            if same or expires_at <= now:
                epoch = epoch if same else epoch + 1
                held, expires_at, running = holder, now + ttl_s, process
                tx.execute(
                    "UPDATE lease SET holder = ?, epoch = ?, expires_at = ?, process = ? "
                    "WHERE id = 1",
                    (held, epoch, expires_at, running),
                )
        return Lease(held, epoch, expires_at - now, float(now), running)

    def release_lease(self, holder: str) -> None:
        with self._write(fenced=False) as tx:
            tx.execute(
                f"UPDATE lease SET expires_at = {self.dialect.now} WHERE id = 1 AND holder = ?",
                (holder,),
            )

    def lease(self) -> Lease:
        [(held, epoch, expires_at, now, running)] = self._query(
            f"SELECT holder, epoch, expires_at, {self.dialect.now}, process FROM lease WHERE id = 1"
        )
        return Lease(held, int(epoch), expires_at - now, float(now), running)

    def see_control_plane(self, name: str, agent_url: str, admin_url: str) -> None:
        with self._write(fenced=False) as tx:
            tx.execute(
                "INSERT INTO control_planes (name, agent_url, admin_url, seen_at) "
                f"VALUES (?, ?, ?, {self.dialect.now}) ON CONFLICT (name) DO UPDATE SET "
                "agent_url = excluded.agent_url, admin_url = excluded.admin_url, "
                "seen_at = excluded.seen_at",
                (name, agent_url, admin_url),
            )

    def control_planes(self) -> list[SeenControlPlane]:
        rows = self._query(
            f"SELECT name, agent_url, admin_url, {self.dialect.now} - seen_at "
            "FROM control_planes ORDER BY name"
        )
        return [SeenControlPlane(*row) for row in rows]

    def fence(self, epoch: int | None) -> None:
        self.fenced_epoch = epoch

    # -- catalogs, marks, meta --------------------------------------------------------------

    def add_catalog(
        self,
        digest: str,
        applied_at: float,
        source: str,
        body: dict[str, Any],
        text: str | None = None,
        once: Once | None = None,
    ) -> int:
        with self._write() as tx:
            if self.dialect.lock_catalogs is not None:
                tx.execute(self.dialect.lock_catalogs)
            [(version,)] = tx.execute(
                "INSERT INTO catalogs (version, digest, applied_at, source, body, text) "
                "VALUES ((SELECT COALESCE(MAX(version), 0) + 1 FROM catalogs), ?, ?, ?, ?, ?) "
                "RETURNING version",
                (digest, applied_at, source, json.dumps(body, sort_keys=True), text),
            ).fetchall()
            self._once(tx, once, version=int(version), digest=digest)
        return int(version)

    def latest_catalog(self) -> StoredCatalog | None:
        rows = self.catalog_history(1)
        return rows[0] if rows else None

    def catalog_history(self, limit: int) -> list[StoredCatalog]:
        rows = self._query(
            "SELECT version, digest, applied_at, source, body, text FROM catalogs "
            "ORDER BY version DESC LIMIT ?",
            (limit,),
        )
        return [StoredCatalog(int(v), d, a, s, json.loads(b), t) for v, d, a, s, b, t in rows]

    def set_rejection(self, rejection: Rejection) -> None:
        data = {"at": rejection.at, "source": rejection.source, "problems": rejection.problems}
        self.set_meta("last_rejection", json.dumps(data))

    def last_rejection(self) -> Rejection | None:
        raw = self.get_meta("last_rejection")
        if raw is None:
            return None
        data = json.loads(raw)
        return Rejection(data["at"], data["source"], tuple(data["problems"]))

    def set_mark(self, mark: StoredMark, once: Once | None = None) -> None:
        with self._write() as tx:
            tx.execute(
                "INSERT INTO node_marks (node, mark, since, drain_deadline) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (node) DO UPDATE SET mark = excluded.mark, since = excluded.since, "
                "drain_deadline = excluded.drain_deadline",
                (mark.node, mark.mark, mark.since, mark.drain_deadline),
            )
            self._once(tx, once)

    def clear_mark(self, node: str, once: Once | None = None) -> None:
        with self._write() as tx:
            tx.execute("DELETE FROM node_marks WHERE node = ?", (node,))
            self._once(tx, once)

    def marks(self) -> list[StoredMark]:
        rows = self._query("SELECT node, mark, since, drain_deadline FROM node_marks ORDER BY node")
        return [StoredMark(*row) for row in rows]

    def get_meta(self, key: str) -> str | None:
        rows = self._query("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: str) -> None:
        with self._write() as tx:
            tx.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def put_meta_once(self, key: str, value: str) -> str:
        with self._write(fenced=False) as tx:
            tx.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                (key, value),
            )
        kept = self.get_meta(key)
        assert kept is not None
        return kept

    # -- keys, join tokens, credentials ----------------------------------------------------

    def put_key(self, key: StoredKey, once: Once | None = None) -> None:
        models = json.dumps(list(key.models)) if key.models is not None else None
        with self._write() as tx:
            tx.execute(
                "INSERT INTO api_keys (name, sha256, prefix, models, rpm, tpm, max_concurrent, "
                "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET sha256 = excluded.sha256, "
                "prefix = excluded.prefix, models = excluded.models, rpm = excluded.rpm, "
                "tpm = excluded.tpm, max_concurrent = excluded.max_concurrent, "
                "created_at = excluded.created_at, expires_at = excluded.expires_at",
                (key.name, key.sha256, key.prefix, models, key.rpm, key.tpm,
                 key.max_concurrent, key.created_at, key.expires_at),
            )  # fmt: skip
            self._once(tx, once)

    def delete_key(self, name: str, once: Once | None = None) -> None:
        with self._write() as tx:
            tx.execute("DELETE FROM api_keys WHERE name = ?", (name,))
            self._once(tx, once)

    def api_keys(self) -> list[StoredKey]:
        rows = self._query(
            "SELECT name, sha256, prefix, models, rpm, tpm, max_concurrent, created_at, "
            "expires_at FROM api_keys ORDER BY name"
        )
        return [
            StoredKey(n, s, p, tuple(json.loads(m)) if m is not None else None, *rest)
            for n, s, p, m, *rest in rows
        ]

    def put_join_token(self, token: StoredJoinToken) -> None:
        with self._write() as tx:
            _put_join_token(tx, token)

    def delete_join_token(self, token_id: str) -> None:
        with self._write() as tx:
            tx.execute("DELETE FROM join_tokens WHERE id = ?", (token_id,))

    def join_tokens(self) -> list[StoredJoinToken]:
        rows = self._query(
            "SELECT id, sha256, created_at, expires_at, uses_left, used, addresses "
            "FROM join_tokens ORDER BY created_at, id"
        )
        return [
            StoredJoinToken(i, s, c, e, u, n, tuple(json.loads(a)) if a else ())
            for i, s, c, e, u, n, a in rows
        ]

    def record_join(self, token: StoredJoinToken, credential: StoredCredential) -> None:
        c = credential
        addresses = None if c.addresses is None else json.dumps(list(c.addresses))
        with self._write() as tx:
            _put_join_token(tx, token)
            tx.execute(
                "INSERT INTO node_credentials (node, sha256, issued_at, token_id, addresses) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (node) DO UPDATE SET "
                "sha256 = excluded.sha256, issued_at = excluded.issued_at, "
                "token_id = excluded.token_id, addresses = excluded.addresses",
                (c.node, c.sha256, c.issued_at, c.token_id, addresses),
            )

    def revoke_node(self, node: str, at: float) -> None:
        with self._write() as tx:
            tx.execute("DELETE FROM node_credentials WHERE node = ?", (node,))
            tx.execute(
                "INSERT INTO revoked_nodes (node, revoked_at) VALUES (?, ?) "
                "ON CONFLICT (node) DO UPDATE SET revoked_at = excluded.revoked_at",
                (node, at),
            )

    def revoked_nodes(self) -> dict[str, float]:
        rows = self._query("SELECT node, revoked_at FROM revoked_nodes")
        return {node: float(at) for node, at in rows}

    def credentials(self) -> list[StoredCredential]:
        rows = self._query(
            "SELECT node, sha256, issued_at, token_id, addresses FROM node_credentials "
            "ORDER BY node"
        )
        return [
            StoredCredential(n, s, i, t, None if a is None else tuple(json.loads(a)))
            for n, s, i, t, a in rows
        ]

    # -- events ----------------------------------------------------------------------------

    def write_events(
        self, writes: Sequence[EventWrite], keep: int, fenced: bool = True
    ) -> list[int]:
        # A few statements for the whole batch, not one per event: a worker thread gives up
        # the GIL around every statement (and every row one returns), and a control plane
        # busy with 10,000 agents' reports took up to 5 ms to hand it back each time, so 500
        # events one by one held SQLite's write lock for seconds, and the lease renewal
        # waiting behind it timed out.
        counted = [(w.id, w.event.count, w.event.last_at) for w in writes if w.id is not None]
        fresh = [w.event for w in writes if w.id is None]
        new_ids: list[int] = []
        with self._write(fenced) as tx:
            for rows in _chunks(counted, EVENT_ROWS_PER_STATEMENT):
                tx.execute(
                    "WITH seen (id, count, last_at) AS (VALUES "
                    + ", ".join(["(?, ?, ?)"] * len(rows))
                    + ") UPDATE events SET count = seen.count, last_at = seen.last_at "
                    "FROM seen WHERE events.id = seen.id",
                    [value for row in rows for value in row],
                )
            for events in _chunks(fresh, EVENT_ROWS_PER_STATEMENT):
                new_ids += self._insert_events(tx, events)
            if new_ids:
                tx.execute("DELETE FROM events WHERE id <= ?", (new_ids[-1] - keep,))
        given = iter(new_ids)
        return [w.id if w.id is not None else next(given) for w in writes]

    def _insert_events(self, tx: Transaction, events: Sequence[StoredEvent]) -> list[int]:
        """Insert `events`, in one statement; their ids, in their order."""
        insert = (
            "INSERT INTO events (type, reason, regarding, message, count, first_at, last_at, "
            "source) VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(events))
        )
        values = [value for e in events for value in (
            e.type, e.reason, e.regarding, e.message, e.count, e.first_at, e.last_at,
            e.source)]  # fmt: skip
        if self.dialect.last_id is not None:
            # Not RETURNING: SQLite's driver steps once per row returned, giving up the GIL
            # each time, and a busy event loop kept it waiting up to 5 ms for each.
            tx.execute(insert, values)
            [(last,)] = tx.execute(f"SELECT {self.dialect.last_id}").fetchall()
            return list(range(int(last) - len(events) + 1, int(last) + 1))
        # RETURNING's order is not promised, but PostgreSQL numbers the rows of one INSERT
        # in the order of its VALUES (another writer's may come between them): ascending.
        return sorted(
            int(id_) for (id_,) in tx.execute(insert + " RETURNING id", values).fetchall()
        )

    def events(
        self,
        regarding: str | EventScope | None = None,
        since: float = 0.0,
        after: int = 0,
        limit: int = 1000,
    ) -> list[StoredEvent]:
        scope = EventScope((regarding,)) if isinstance(regarding, str) else regarding
        where, params = ("", []) if scope is None else _scoped(scope)
        rows = self._query(
            "SELECT id, type, reason, regarding, message, count, first_at, last_at, source "
            f"FROM events WHERE last_at >= ? AND id > ?{where} "
            "ORDER BY last_at DESC, id DESC LIMIT ?",
            (since, after, *params, limit),
        )
        found = [StoredEvent(int(i), t, r, g, m, int(c), *rest) for i, t, r, g, m, c, *rest in
                 reversed(rows)]  # fmt: skip
        if scope is not None and scope.shards_on is not None:
            # LIKE in SQLite ignores case: what the query found, as the scope says it.
            found = [e for e in found if _in_scope(scope, e)]
        return found

    # -- usage -----------------------------------------------------------------------------

    def add_usage(self, run: str, batch: int, rows: list[StoredUsage], now: float) -> bool:
        with self._write() as tx:
            seen = tx.execute(
                "INSERT INTO usage_batches (run, batch, at) VALUES (?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (run, batch, now),
            )
            if seen.rowcount == 0:
                return False
            tx.executemany(
                "INSERT INTO usage (key, model, hour, requests, prompt_tokens, "
                "completion_tokens, errors, last_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (key, model, hour) DO UPDATE SET "
                "requests = usage.requests + excluded.requests, "
                "prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = usage.completion_tokens + excluded.completion_tokens, "
                "errors = usage.errors + excluded.errors, "
                "last_at = CASE WHEN usage.last_at > excluded.last_at THEN usage.last_at "
                "ELSE excluded.last_at END",
                [(r.key, r.model, r.hour, r.requests, r.prompt_tokens, r.completion_tokens,
                  r.errors, r.last_at) for r in rows],
            )  # fmt: skip
            tx.execute("DELETE FROM usage_batches WHERE at < ?", (now - BATCH_MEMORY_S,))
        return True

    def usage(
        self, key: str | None = None, model: str | None = None, since: int = 0
    ) -> list[StoredUsage]:
        rows = self._query(
            "SELECT key, model, hour, requests, prompt_tokens, completion_tokens, errors, "
            "last_at FROM usage WHERE hour >= ? AND (CAST(? AS TEXT) IS NULL OR key = ?) "
            "AND (CAST(? AS TEXT) IS NULL OR model = ?) ORDER BY hour, key, model",
            (since, key, key, model, model),
        )
        return [StoredUsage(k, m, int(h), int(r), int(p), int(c), int(e), at)
                for k, m, h, r, p, c, e, at in rows]  # fmt: skip

    def usage_totals(self) -> dict[str, tuple[int, int, float]]:
        rows = self._query(
            "SELECT key, SUM(requests), SUM(prompt_tokens + completion_tokens), MAX(last_at) "
            "FROM usage GROUP BY key"
        )
        return {key: (int(requests), int(tokens), last) for key, requests, tokens, last in rows}

    def put_points(self, points: Sequence[StoredPoint], forget: Mapping[int, float]) -> None:
        with self._write() as tx:
            for chunk in _chunks(points, POINT_ROWS_PER_STATEMENT):
                rows = ", ".join("(?, ?, ?, ?, ?)" for _ in chunk)
                tx.execute(
                    f"INSERT INTO series (kind, subject, step, at, body) VALUES {rows} "
                    "ON CONFLICT (kind, subject, step, at) DO UPDATE SET body = excluded.body",
                    [v for p in chunk for v in (p.kind, p.subject, p.step, p.at, p.body)],
                )
            for step, before in forget.items():
                tx.execute("DELETE FROM series WHERE step = ? AND at < ?", (step, before))

    def points(
        self, kind: str | None, subject: str | None, step: int, since: float
    ) -> list[StoredPoint]:
        rows = self._query(
            "SELECT kind, subject, step, at, body FROM series WHERE step = ? AND at >= ? "
            "AND (CAST(? AS TEXT) IS NULL OR kind = ?) "
            "AND (CAST(? AS TEXT) IS NULL OR subject = ?) ORDER BY at",
            (step, since, kind, kind, subject, subject),
        )
        return [StoredPoint(k, s, int(st), int(at), body) for k, s, st, at, body in rows]


def _put_join_token(tx: Transaction, t: StoredJoinToken) -> None:
    tx.execute(
        "INSERT INTO join_tokens (id, sha256, created_at, expires_at, uses_left, used, "
        "addresses) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
        "sha256 = excluded.sha256, created_at = excluded.created_at, "
        "expires_at = excluded.expires_at, uses_left = excluded.uses_left, "
        "used = excluded.used, addresses = excluded.addresses",
        (t.id, t.sha256, t.created_at, t.expires_at, t.uses_left, t.used,
         json.dumps(list(t.addresses)) if t.addresses else None),
    )  # fmt: skip


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """`items` in consecutive slices of at most `size`."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _scoped(scope: EventScope) -> tuple[str, list[Any]]:
    """The condition (" AND (...)") and its parameters that take the events of `scope`.
    Lengths are written into the statement: they are numbers this code counted."""
    terms: list[str] = []
    params: list[Any] = []
    for one in scope.objects:
        if "/" in one:
            terms.append("regarding = ?")
            params.append(one)
        else:
            terms.append(f"substr(regarding, 1, {len(one) + 1}) = ?")
            params.append(f"{one}/")
    for stem in scope.families:
        terms.append(
            f"(substr(regarding, 1, {len(stem)}) = ? "
            f"AND length(regarding) = {len(stem) + FAMILY_TAIL})"
        )
        params.append(stem)
    if scope.shards_on is not None:
        node = _like(scope.shards_on)
        terms.append(
            "(substr(regarding, 1, 8) = 'replica/' AND (message LIKE ? ESCAPE '\\' "
            "OR message LIKE ? ESCAPE '\\' OR message LIKE ? ESCAPE '\\'))"
        )
        params += [f"shard % on {node}", f"shard % on {node}:%", f"shard % on {node} %"]
    if not terms:
        return " AND 1 = 0", []
    return f" AND ({' OR '.join(terms)})", params


def _like(text: str) -> str:
    """`text` as a LIKE pattern that matches only itself (escaped with a backslash)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _in_scope(scope: EventScope, event: StoredEvent) -> bool:
    """Whether `event` is of `scope`, exactly (the query's LIKE may ignore case)."""
    if event.regarding.startswith("replica/") and scope.shards_on is not None:
        shard = re.match(r"shard \d+ on (.*?)(?=[: ]|$)", event.message)
        if shard is not None and shard.group(1) == scope.shards_on:
            return True
    return any(
        event.regarding == one or event.regarding.startswith(f"{one}/") for one in scope.objects
    ) or any(
        event.regarding.startswith(s) and len(event.regarding) == len(s) + FAMILY_TAIL
        for s in scope.families
    )
