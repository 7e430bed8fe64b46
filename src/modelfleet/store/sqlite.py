"""The store as one SQLite file in the control plane's state dir.

One connection, used by one call at a time (a lock): the control plane makes its store calls
from worker threads, off its event loop. Each write is `BEGIN IMMEDIATE ... COMMIT`, which
takes SQLite's write lock at once: a second process on the same file (a test's second
control plane) waits for it up to `BUSY_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modelfleet.host.files import PRIVATE, private_dir
from modelfleet.store import SCHEMA_VERSION, StoreError, WriteHealth, check_schema
from modelfleet.store.sql import Dialect, SqlStore, Transaction

__all__ = ["SqliteStore", "StoreError"]

BUSY_TIMEOUT_S = 5.0

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
# Version 4: the text each catalog was applied from.
_TEXT = "ALTER TABLE catalogs ADD COLUMN text TEXT"
# Version 5: the points the dashboard plots.
_SERIES = """
CREATE TABLE IF NOT EXISTS series (
    kind    TEXT NOT NULL,
    subject TEXT NOT NULL,
    step    INTEGER NOT NULL,
    at      INTEGER NOT NULL,
    body    TEXT NOT NULL,
    PRIMARY KEY (kind, subject, step, at)
);
CREATE INDEX IF NOT EXISTS series_step_at ON series (step, at);
"""

# Version 6: the addresses a node may advertise (a join token's, a credential's), and the node
# names revoked (or deleted).
_ADDRESSES = {
    table: f"ALTER TABLE {table} ADD COLUMN addresses TEXT"
    for table in ("join_tokens", "node_credentials")
}
_REVOKED_NODES = """
CREATE TABLE IF NOT EXISTS revoked_nodes (
    node       TEXT PRIMARY KEY,
    revoked_at REAL NOT NULL
)
"""
# Version 7: the process that holds the lease.
_PROCESS = "ALTER TABLE lease ADD COLUMN process TEXT NOT NULL DEFAULT ''"

# Version 8: the request ids of changes made once (`Once`).
_REQUESTS = """
CREATE TABLE IF NOT EXISTS requests (
    id      TEXT PRIMARY KEY,
    route   TEXT NOT NULL,
    outcome TEXT NOT NULL,
    at      REAL NOT NULL
)
"""

DIALECT = Dialect(
    # The store's clock, in seconds since the epoch: SQLite's own (the host's: it runs here).
    now="((julianday('now') - 2440587.5) * 86400.0)",
    lock_row="",  # BEGIN IMMEDIATE holds the whole file's write lock
    share_row="",
    lock_catalogs=None,
    placeholder="?",
    last_id="last_insert_rowid()",
)


def _make_private(path: Path) -> None:
    """Make the store's file readable by its owner alone before SQLite opens it: SQLite makes
    its -wal and -shm files with the mode of the database file. An older store is narrowed."""
    private_dir(path.parent)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if name.exists():
            os.chmod(name, PRIVATE)


class SqliteStore(SqlStore):
    """`Store` on SQLite. `path` may be ":memory:" (tests)."""

    dialect = DIALECT

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self.where = self.path
        if self.path != ":memory:":
            try:
                _make_private(Path(self.path))
            except OSError as exc:
                raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        self.health = WriteHealth(self.path)
        self.fenced_epoch = None

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
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(catalogs)")}
            if found < 4 and "text" not in columns:  # SQLite has no ADD COLUMN IF NOT EXISTS
                self._db.execute(_TEXT)
            if found < 5:
                for statement in _SERIES.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
            for table, add in _ADDRESSES.items():
                columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                if found < 6 and "addresses" not in columns:
                    self._db.execute(add)
            if found < 6:
                self._db.execute(_REVOKED_NODES)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(lease)")}
            if found < 7 and "process" not in columns:
                self._db.execute(_PROCESS)
            if found < 8:
                self._db.execute(_REQUESTS)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    @contextmanager
    def _transaction(self) -> Iterator[Transaction]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on an error. A COMMIT that fails (the disk
        is full) is rolled back too: the write changed nothing."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot write the store {self.path}: {exc}") from exc
            try:
                yield _Transaction(self._db)
                self._db.execute("COMMIT")
            except BaseException as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot write the store {self.path}: {exc}") from exc
                raise

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read the store {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)
