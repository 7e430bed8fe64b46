"""The store as one SQLite file in the control plane's state dir."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from modelfleet.files import PRIVATE, private_dir
from modelfleet.store import (
    SCHEMA_VERSION,
    Fenced,
    Lease,
    Rejection,
    SeenControlPlane,
    StoredCatalog,
    StoredCredential,
    StoredEvent,
    StoredJoinToken,
    StoredKey,
    StoredMark,
    StoredUsage,
    StoreError,
    WriteHealth,
    check_schema,
    fenced_message,
)

__all__ = ["SqliteStore", "StoreError"]

# A batch seen longer ago than this is forgotten: no router resends one that old.
_BATCH_MEMORY_S = 86400.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS catalogs (
    version    INTEGER PRIMARY KEY,
    digest     TEXT NOT NULL,
    applied_at REAL NOT NULL,
    source     TEXT NOT NULL,
    body       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS node_marks (
    node           TEXT PRIMARY KEY,
    mark           TEXT NOT NULL,
    since          REAL NOT NULL,
    drain_deadline REAL
);
CREATE TABLE IF NOT EXISTS api_keys (
    name           TEXT PRIMARY KEY,
    sha256         TEXT NOT NULL UNIQUE,
    prefix         TEXT NOT NULL,
    models         TEXT,
    rpm            INTEGER,
    tpm            INTEGER,
    max_concurrent INTEGER,
    created_at     REAL NOT NULL,
    expires_at     REAL
);
CREATE TABLE IF NOT EXISTS usage (
    key               TEXT NOT NULL,
    model             TEXT NOT NULL,
    hour              INTEGER NOT NULL,
    requests          INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    errors            INTEGER NOT NULL,
    last_at           REAL NOT NULL,
    PRIMARY KEY (key, model, hour)
);
CREATE TABLE IF NOT EXISTS usage_batches (
    run   TEXT NOT NULL,
    batch INTEGER NOT NULL,
    at    REAL NOT NULL,
    PRIMARY KEY (run, batch)
);
CREATE TABLE IF NOT EXISTS join_tokens (
    id         TEXT PRIMARY KEY,
    sha256     TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    uses_left  INTEGER,
    used       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS node_credentials (
    node      TEXT PRIMARY KEY,
    sha256    TEXT NOT NULL UNIQUE,
    issued_at REAL NOT NULL,
    token_id  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    type      TEXT NOT NULL,
    reason    TEXT NOT NULL,
    regarding TEXT NOT NULL,
    message   TEXT NOT NULL,
    count     INTEGER NOT NULL,
    first_at  REAL NOT NULL,
    last_at   REAL NOT NULL,
    source    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_regarding ON events (regarding);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

# Version 2: the control planes' lease (one row).
_LEASE = """
CREATE TABLE IF NOT EXISTS lease (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    holder     TEXT NOT NULL,
    epoch      INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
INSERT OR IGNORE INTO lease (id, holder, epoch, expires_at) VALUES (1, '', 0, 0);
"""
# Version 3: the control planes that said they were alive, and where they are reached.
_PLANES = """
CREATE TABLE IF NOT EXISTS control_planes (
    name      TEXT PRIMARY KEY,
    agent_url TEXT NOT NULL,
    admin_url TEXT NOT NULL,
    seen_at   REAL NOT NULL
);
"""
# The store's clock, in seconds since the epoch: SQLite's own (the host's, since it runs here).
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def _make_private(path: Path) -> None:
    """Make the store's file readable by its owner alone before SQLite opens it: SQLite makes
    its -wal and -shm files with the mode of the database file. An older store is narrowed."""
    private_dir(path.parent)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if name.exists():
            os.chmod(name, PRIVATE)


class SqliteStore:
    """`Store` on SQLite. `path` may be ":memory:" (tests)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self.where = self.path
        if self.path != ":memory:":
            try:
                _make_private(Path(self.path))
            except OSError as exc:
                raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        self.health = WriteHealth(self.path)
        self.fenced_epoch: int | None = None  # see `fence`

    def _migrate(self) -> None:
        """Bring the schema to SCHEMA_VERSION, under SQLite's write lock (BEGIN IMMEDIATE):
        version 1 is the tables as they were before versions were kept, which created them
        if missing, so a store made then is version 0 and takes version 1 as it is."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            found = self._db.execute("PRAGMA user_version").fetchone()[0]
            check_schema(found, self.path)
            for version, script in ((1, _SCHEMA), (2, _LEASE), (3, _PLANES)):
                if found < version:
                    for statement in script.split(";"):
                        if statement.strip():
                            self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def write_problem(self) -> str | None:
        return self.health.problem()

    def _wrote(self, error: sqlite3.Error | None) -> None:
        self.health.wrote(error)

    def add_catalog(self, digest: str, applied_at: float, source: str, body: dict[str, Any]) -> int:
        with self._write():
            cursor = self._db.execute(
                "INSERT INTO catalogs (version, digest, applied_at, source, body) "
                "VALUES ((SELECT COALESCE(MAX(version), 0) + 1 FROM catalogs), ?, ?, ?, ?)",
                (digest, applied_at, source, json.dumps(body, sort_keys=True)),
            )
            return int(cursor.lastrowid or 0)

    def latest_catalog(self) -> StoredCatalog | None:
        rows = self.catalog_history(1)
        return rows[0] if rows else None

    def catalog_history(self, limit: int) -> list[StoredCatalog]:
        rows = self._db.execute(
            "SELECT version, digest, applied_at, source, body FROM catalogs "
            "ORDER BY version DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [StoredCatalog(v, d, a, s, json.loads(b)) for v, d, a, s, b in rows]

    def set_rejection(self, rejection: Rejection) -> None:
        data = {"at": rejection.at, "source": rejection.source, "problems": rejection.problems}
        self.set_meta("last_rejection", json.dumps(data))

    def last_rejection(self) -> Rejection | None:
        raw = self.get_meta("last_rejection")
        if raw is None:
            return None
        data = json.loads(raw)
        return Rejection(data["at"], data["source"], tuple(data["problems"]))

    def set_mark(self, mark: StoredMark) -> None:
        with self._write():
            self._db.execute(
                "INSERT INTO node_marks (node, mark, since, drain_deadline) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (node) DO UPDATE SET mark = excluded.mark, since = excluded.since, "
                "drain_deadline = excluded.drain_deadline",
                (mark.node, mark.mark, mark.since, mark.drain_deadline),
            )

    def clear_mark(self, node: str) -> None:
        with self._write():
            self._db.execute("DELETE FROM node_marks WHERE node = ?", (node,))

    def marks(self) -> list[StoredMark]:
        rows = self._db.execute(
            "SELECT node, mark, since, drain_deadline FROM node_marks ORDER BY node"
        ).fetchall()
        return [StoredMark(*row) for row in rows]

    def put_key(self, key: StoredKey) -> None:
        models = json.dumps(list(key.models)) if key.models is not None else None
        with self._write():
            self._db.execute(
                "INSERT OR REPLACE INTO api_keys (name, sha256, prefix, models, rpm, tpm, "
                "max_concurrent, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key.name, key.sha256, key.prefix, models, key.rpm, key.tpm,
                 key.max_concurrent, key.created_at, key.expires_at),
            )  # fmt: skip

    def delete_key(self, name: str) -> None:
        with self._write():
            self._db.execute("DELETE FROM api_keys WHERE name = ?", (name,))

    def api_keys(self) -> list[StoredKey]:
        rows = self._db.execute(
            "SELECT name, sha256, prefix, models, rpm, tpm, max_concurrent, created_at, "
            "expires_at FROM api_keys ORDER BY name"
        ).fetchall()
        return [
            StoredKey(n, s, p, tuple(json.loads(m)) if m is not None else None, *rest)
            for n, s, p, m, *rest in rows
        ]

    def put_join_token(self, token: StoredJoinToken) -> None:
        with self._write():
            self._put_join_token(token)

    def _put_join_token(self, t: StoredJoinToken) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO join_tokens (id, sha256, created_at, expires_at, uses_left, "
            "used) VALUES (?, ?, ?, ?, ?, ?)",
            (t.id, t.sha256, t.created_at, t.expires_at, t.uses_left, t.used),
        )

    def delete_join_token(self, token_id: str) -> None:
        with self._write():
            self._db.execute("DELETE FROM join_tokens WHERE id = ?", (token_id,))

    def join_tokens(self) -> list[StoredJoinToken]:
        rows = self._db.execute(
            "SELECT id, sha256, created_at, expires_at, uses_left, used FROM join_tokens "
            "ORDER BY created_at, id"
        ).fetchall()
        return [StoredJoinToken(*row) for row in rows]

    def record_join(self, token: StoredJoinToken, credential: StoredCredential) -> None:
        c = credential
        with self._write():
            self._put_join_token(token)
            self._db.execute(
                "INSERT OR REPLACE INTO node_credentials (node, sha256, issued_at, token_id) "
                "VALUES (?, ?, ?, ?)",
                (c.node, c.sha256, c.issued_at, c.token_id),
            )

    def delete_credential(self, node: str) -> None:
        with self._write():
            self._db.execute("DELETE FROM node_credentials WHERE node = ?", (node,))

    def credentials(self) -> list[StoredCredential]:
        rows = self._db.execute(
            "SELECT node, sha256, issued_at, token_id FROM node_credentials ORDER BY node"
        ).fetchall()
        return [StoredCredential(*row) for row in rows]

    def add_event(self, event: StoredEvent, keep: int) -> int:
        e = event
        with self._write():
            cursor = self._db.execute(
                "INSERT INTO events (type, reason, regarding, message, count, first_at, "
                "last_at, source) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (e.type, e.reason, e.regarding, e.message, e.count, e.first_at, e.last_at,
                 e.source),
            )  # fmt: skip
            new = int(cursor.lastrowid or 0)
            self._db.execute("DELETE FROM events WHERE id <= ?", (new - keep,))
        return new

    def repeat_event(self, event_id: int, count: int, at: float) -> None:
        with self._write():
            self._db.execute(
                "UPDATE events SET count = ?, last_at = ? WHERE id = ?", (count, at, event_id)
            )

    def events(
        self, regarding: str | None = None, since: float = 0.0, after: int = 0, limit: int = 1000
    ) -> list[StoredEvent]:
        kind = regarding if regarding is not None and "/" not in regarding else None
        one = regarding if regarding is not None and "/" in regarding else None
        rows = self._db.execute(
            "SELECT id, type, reason, regarding, message, count, first_at, last_at, source "
            "FROM events WHERE last_at >= ? AND id > ? AND (? IS NULL OR regarding = ?) "
            "AND (? IS NULL OR regarding LIKE ? || '/%') ORDER BY id DESC LIMIT ?",
            (since, after, one, one, kind, kind, limit),
        ).fetchall()
        return [StoredEvent(*row) for row in reversed(rows)]

    def add_usage(self, run: str, batch: int, rows: list[StoredUsage], now: float) -> bool:
        with self._write():
            seen = self._db.execute(
                "INSERT OR IGNORE INTO usage_batches (run, batch, at) VALUES (?, ?, ?)",
                (run, batch, now),
            )
            if seen.rowcount == 0:
                return False
            self._db.executemany(
                "INSERT INTO usage (key, model, hour, requests, prompt_tokens, "
                "completion_tokens, errors, last_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (key, model, hour) DO UPDATE SET "
                "requests = requests + excluded.requests, "
                "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens, "
                "errors = errors + excluded.errors, "
                "last_at = MAX(last_at, excluded.last_at)",
                [(r.key, r.model, r.hour, r.requests, r.prompt_tokens, r.completion_tokens,
                  r.errors, r.last_at) for r in rows],
            )  # fmt: skip
            self._db.execute("DELETE FROM usage_batches WHERE at < ?", (now - _BATCH_MEMORY_S,))
        return True

    def usage(
        self, key: str | None = None, model: str | None = None, since: int = 0
    ) -> list[StoredUsage]:
        rows = self._db.execute(
            "SELECT key, model, hour, requests, prompt_tokens, completion_tokens, errors, "
            "last_at FROM usage WHERE hour >= ? AND (? IS NULL OR key = ?) "
            "AND (? IS NULL OR model = ?) ORDER BY hour, key, model",
            (since, key, key, model, model),
        ).fetchall()
        return [StoredUsage(*row) for row in rows]

    def usage_totals(self) -> dict[str, tuple[int, int, float]]:
        rows = self._db.execute(
            "SELECT key, SUM(requests), SUM(prompt_tokens + completion_tokens), MAX(last_at) "
            "FROM usage GROUP BY key"
        ).fetchall()
        return {key: (requests, tokens, last) for key, requests, tokens, last in rows}

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._write():
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def put_meta_once(self, key: str, value: str) -> str:
        with self._write(fenced=False):
            self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
        kept = self.get_meta(key)
        assert kept is not None
        return kept

    def take_lease(self, holder: str, ttl_s: float) -> Lease:
        with self._write(fenced=False):
            held, epoch, expires_at, now = self._db.execute(
                f"SELECT holder, epoch, expires_at, {_NOW} FROM lease WHERE id = 1"
            ).fetchone()
            if held == holder or expires_at <= now:
                epoch = epoch if held == holder else epoch + 1
                held, expires_at = holder, now + ttl_s
                self._db.execute(
                    "UPDATE lease SET holder = ?, epoch = ?, expires_at = ? WHERE id = 1",
                    (held, epoch, expires_at),
                )
        return Lease(held, int(epoch), expires_at - now)

    def release_lease(self, holder: str) -> None:
        with self._write(fenced=False):
            self._db.execute(
                f"UPDATE lease SET expires_at = {_NOW} WHERE id = 1 AND holder = ?", (holder,)
            )

    def lease(self) -> Lease:
        held, epoch, expires_at, now = self._db.execute(
            f"SELECT holder, epoch, expires_at, {_NOW} FROM lease WHERE id = 1"
        ).fetchone()
        return Lease(held, int(epoch), expires_at - now)

    def see_control_plane(self, name: str, agent_url: str, admin_url: str) -> None:
        with self._write(fenced=False):
            self._db.execute(
                "INSERT INTO control_planes (name, agent_url, admin_url, seen_at) "
                f"VALUES (?, ?, ?, {_NOW}) ON CONFLICT (name) DO UPDATE SET "
                "agent_url = excluded.agent_url, admin_url = excluded.admin_url, "
                "seen_at = excluded.seen_at",
                (name, agent_url, admin_url),
            )

    def control_planes(self) -> list[SeenControlPlane]:
        rows = self._db.execute(
            f"SELECT name, agent_url, admin_url, {_NOW} - seen_at FROM control_planes ORDER BY name"
        ).fetchall()
        return [SeenControlPlane(*row) for row in rows]

    def fence(self, epoch: int | None) -> None:
        self.fenced_epoch = epoch

    def close(self) -> None:
        self._db.close()

    def _write(self, fenced: bool = True) -> _Transaction:
        return _Transaction(self, self.fenced_epoch if fenced else None)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on an error, which becomes a StoreError. A
    COMMIT that fails (the disk is full) is rolled back too: the write changed nothing. With
    an `epoch`, the lease's is checked first, under the same write lock (Fenced)."""

    def __init__(self, store: SqliteStore, epoch: int | None) -> None:
        self._store = store
        self._db = store._db
        self._epoch = epoch

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._store._wrote(exc)
            raise StoreError(f"cannot write the store {self._store.path}: {exc}") from exc
        if self._epoch is not None:
            held, epoch = self._db.execute(
                "SELECT holder, epoch FROM lease WHERE id = 1"
            ).fetchone()
            if epoch != self._epoch:
                self._db.execute("ROLLBACK")
                raise Fenced(fenced_message(self._epoch, epoch, held))

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _tb: Any
    ) -> None:
        if kind is None:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as failed:
                exc = failed
            else:
                self._store._wrote(None)
                return
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            self._store._wrote(exc)
            raise StoreError(f"cannot write the store {self._store.path}: {exc}") from exc
