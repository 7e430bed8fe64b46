"""The store in a PostgreSQL database (`store: postgresql://...` in the control plane's config).

psycopg 3 with a small connection pool. The conninfo is libpq's, so several hosts and
`target_session_attrs=read-write` work as libpq documents them: after a failover the pool's
next connection goes to the new primary. Each call is one transaction; a failed one (the
server gone, a full disk) raises StoreError and changed nothing.

Every wait is bounded (`Bounds`, from the lease's TTL): connecting, waiting for a lock
(`lock_timeout`), a statement (`statement_timeout`), a session left inside a transaction
(`idle_in_transaction_session_timeout`: the server ends the session of a control plane
frozen in the middle of a write, and with it the lock it held on the lease row), and a peer
that went away (TCP keepalives and `tcp_user_timeout`, on both ends). A frozen peer holding
the lease row delays a takeover by those bounds at most, not for as long as it is frozen.

The pool connects again after a failure at delays that double up to a short cap (`RECONNECT`):
psycopg's own doubled without one (1, 2, 4 ... 32 s), so after PostgreSQL had been stopped a
minute and started, changes stayed refused for up to 53 s more.

The schema is versioned (a `schema_version` table) and brought up to SCHEMA_VERSION at open
under `pg_advisory_xact_lock`, so that two control planes starting together never migrate at
once; a schema newer than this modelfleet knows is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from modelfleet.core.backoff import Backoff
from modelfleet.host.pgserver import redacted
from modelfleet.store import (
    SCHEMA_VERSION,
    OutcomeUnknown,
    StoreError,
    StoreUnreachable,
    WriteHealth,
    check_schema,
)
from modelfleet.store.sql import Dialect, SqlStore, Transaction

__all__ = ["Bounds", "PostgresStore"]
# The advisory lock every migration is made under: any number, the same in every version.
_MIGRATION_LOCK = 0x6D666C74  # "mflt"

# One entry per schema version: what brings the version before it to this one.
MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE catalogs (
    version    BIGINT PRIMARY KEY,
    digest     TEXT NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL,
    source     TEXT NOT NULL,
    body       TEXT NOT NULL
);
CREATE TABLE node_marks (
    node           TEXT PRIMARY KEY,
    mark           TEXT NOT NULL,
    since          DOUBLE PRECISION NOT NULL,
    drain_deadline DOUBLE PRECISION
);
CREATE TABLE api_keys (
    name           TEXT PRIMARY KEY,
    sha256         TEXT NOT NULL UNIQUE,
    prefix         TEXT NOT NULL,
    models         TEXT,
    rpm            BIGINT,
    tpm            BIGINT,
    max_concurrent BIGINT,
    created_at     DOUBLE PRECISION NOT NULL,
    expires_at     DOUBLE PRECISION
);
CREATE TABLE usage (
    key               TEXT NOT NULL,
    model             TEXT NOT NULL,
    hour              BIGINT NOT NULL,
    requests          BIGINT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    errors            BIGINT NOT NULL,
    last_at           DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (key, model, hour)
);
CREATE TABLE usage_batches (
    run   TEXT NOT NULL,
    batch BIGINT NOT NULL,
    at    DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run, batch)
);
CREATE TABLE join_tokens (
    id         TEXT PRIMARY KEY,
    sha256     TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    uses_left  BIGINT,
    used       BIGINT NOT NULL
);
CREATE TABLE node_credentials (
    node      TEXT PRIMARY KEY,
    sha256    TEXT NOT NULL UNIQUE,
    issued_at DOUBLE PRECISION NOT NULL,
    token_id  TEXT NOT NULL
);
CREATE TABLE events (
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type      TEXT NOT NULL,
    reason    TEXT NOT NULL,
    regarding TEXT NOT NULL,
    message   TEXT NOT NULL,
    count     BIGINT NOT NULL,
    first_at  DOUBLE PRECISION NOT NULL,
    last_at   DOUBLE PRECISION NOT NULL,
    source    TEXT NOT NULL
);
CREATE INDEX events_regarding ON events (regarding);
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
""",
    2: """
CREATE TABLE lease (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    holder     TEXT NOT NULL,
    epoch      BIGINT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
INSERT INTO lease (id, holder, epoch, expires_at) VALUES (1, '', 0, 0);
""",
    3: """
CREATE TABLE control_planes (
    name      TEXT PRIMARY KEY,
    agent_url TEXT NOT NULL,
    admin_url TEXT NOT NULL,
    seen_at   DOUBLE PRECISION NOT NULL
);
""",
    4: "ALTER TABLE catalogs ADD COLUMN IF NOT EXISTS text TEXT;",
    5: """
CREATE TABLE IF NOT EXISTS series (
    kind    TEXT NOT NULL,
    subject TEXT NOT NULL,
    step    BIGINT NOT NULL,
    at      BIGINT NOT NULL,
    body    TEXT NOT NULL,
    PRIMARY KEY (kind, subject, step, at)
);
CREATE INDEX IF NOT EXISTS series_step_at ON series (step, at);
""",
    6: """
ALTER TABLE join_tokens ADD COLUMN IF NOT EXISTS addresses TEXT;
ALTER TABLE node_credentials ADD COLUMN IF NOT EXISTS addresses TEXT;
CREATE TABLE IF NOT EXISTS revoked_nodes (
    node       TEXT PRIMARY KEY,
    revoked_at DOUBLE PRECISION NOT NULL
);
""",
    7: "ALTER TABLE lease ADD COLUMN IF NOT EXISTS process TEXT NOT NULL DEFAULT '';",
    8: """
CREATE TABLE IF NOT EXISTS requests (
    id      TEXT PRIMARY KEY,
    route   TEXT NOT NULL,
    outcome TEXT NOT NULL,
    at      DOUBLE PRECISION NOT NULL
);
""",
}
DIALECT = Dialect(
    # The store's clock: the database server's, in seconds since the epoch.
    now="extract(epoch from clock_timestamp())::double precision",
    lock_row=" FOR UPDATE",
    share_row=" FOR SHARE",
    # Two leaders' catalogs (one of them fenced out) must not both take MAX + 1.
    lock_catalogs="LOCK TABLE catalogs IN EXCLUSIVE MODE",
    placeholder="%s",
    last_id=None,
)


@dataclass(frozen=True)
class Bounds:
    """How long a store call may wait for each thing, in seconds."""

    connect: float  # a new connection (libpq counts whole seconds, at least 2)
    pool: float  # a free connection of the pool
    lock: float  # a row or table lock (`lock_timeout`)
    statement: float  # one statement (`statement_timeout`)
    idle_in_transaction: float  # a session inside a transaction that sends nothing
    keepalive: float  # a silent peer: TCP keepalives begin after this, and unacknowledged
    # data gives up after it (`tcp_user_timeout`)

    @classmethod
    def for_lease(cls, ttl: float) -> Bounds:
        """Bounds below a lease of `ttl` seconds, so that no wait on the store outlasts a
        lease: a lock and a statement give up well within it, and a session frozen inside a
        transaction is ended by the server one TTL after its last word."""
        return cls(
            connect=max(2.0, ttl),
            pool=max(1.0, ttl),
            lock=max(0.2, ttl / 3),
            statement=max(0.5, 2 * ttl / 3),
            idle_in_transaction=max(1.0, ttl),
            keepalive=max(1.0, ttl),
        )

    def session_settings(self) -> dict[str, str]:
        """What each session of the pool is set to, as PostgreSQL's settings."""
        return {
            "lock_timeout": f"{round(self.lock * 1000)}ms",
            "statement_timeout": f"{round(self.statement * 1000)}ms",
            "idle_in_transaction_session_timeout": f"{round(self.idle_in_transaction * 1000)}ms",
            # The server's side of the same TCP connection: it notices a control plane's host
            # gone as soon as the control plane notices the server's.
            "tcp_keepalives_idle": str(math.ceil(self.keepalive)),
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "3",
        }

    def connect_parameters(self) -> dict[str, Any]:
        """libpq's parameters for each connection the pool makes."""
        return {
            "connect_timeout": math.ceil(self.connect),
            "keepalives": 1,
            "keepalives_idle": math.ceil(self.keepalive),
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": round(self.keepalive * 1000),
        }


DEFAULT_BOUNDS = Bounds.for_lease(3.0)  # the control plane's default lease_ttl

# How soon the pool tries to connect again after a failed try: the store back, a connection
# comes within a second (the next lease renewal then ends the outage).
RECONNECT = Backoff(base=0.25, cap=1.0, reset_after=math.inf)


class ReconnectAttempt(AttemptWithBackoff):
    """psycopg's record of one connection's tries, its delays `RECONNECT`'s: they double up to
    its cap, and stop growing there; tries give up after `timeout` as psycopg's do."""

    def __init__(self, *, timeout: float) -> None:
        super().__init__(timeout=timeout)
        self.failures = 0

    def update_delay(self, now: float) -> None:
        if not self.failures:
            self.give_up_at = now + self.timeout
        self.failures += 1
        self.delay = min(RECONNECT.delay(self.failures), max(0.0, self.give_up_at - now))


class _Pool(ConnectionPool[psycopg.Connection[Any]]):
    """psycopg's pool, its connections tried again by `ReconnectAttempt`."""

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        attempt = attempt or ReconnectAttempt(timeout=self.reconnect_timeout)
        super()._add_connection(attempt, growing)


class PostgresStore(SqlStore):
    """`Store` on PostgreSQL at `conninfo` (a libpq URL or key=value string)."""

    dialect = DIALECT

    def __init__(self, conninfo: str, pool_size: int = 4, bounds: Bounds = DEFAULT_BOUNDS) -> None:
        self.where = redacted(conninfo)
        self.health = WriteHealth(self.where)
        self.fenced_epoch = None
        self.bounds = bounds
        settings = bounds.session_settings()

        def configure(conn: psycopg.Connection[Any]) -> None:
            for name, value in settings.items():
                conn.execute("SELECT set_config(%s, %s, false)", (name, value))

        try:
            self._pool = _Pool(
                conninfo,
                min_size=1,
                max_size=pool_size,
                timeout=bounds.pool,
                kwargs={"autocommit": True, **bounds.connect_parameters()},
                configure=configure,
                check=ConnectionPool.check_connection,
                open=False,
            )
            self._pool.open(wait=True, timeout=bounds.connect + bounds.pool)
            self._migrate()
        except (psycopg.Error, PoolTimeout) as exc:
            raise _failure("open", self.where, exc) from exc

    def _migrate(self) -> None:
        with self._pool.connection() as conn, conn.transaction():
            # Control planes starting together wait here for the first one's migration.
            conn.execute("SET LOCAL lock_timeout = '60s'")
            conn.execute("SET LOCAL statement_timeout = '60s'")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            found = int(row[0]) if row and row[0] is not None else 0
            check_schema(found, self.where)
            for version in range(found + 1, SCHEMA_VERSION + 1):
                conn.execute(MIGRATIONS[version])
                conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))

    @contextmanager
    def _transaction(self) -> Iterator[Transaction]:
        """One transaction. A failure before its COMMIT was sent rolled it back (the server
        ends a transaction whose connection broke); one while it committed (the connection
        broke before the server said) is OutcomeUnknown: it may have been made."""
        committing = False
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield _Transaction(conn)
                committing = True
        except (psycopg.Error, PoolTimeout) as exc:
            failure = _failure("write", self.where, exc)
            if committing and isinstance(failure, StoreUnreachable):
                raise OutcomeUnknown(f"{failure}, while it committed") from exc
            raise failure from exc

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            with self._pool.connection() as conn:
                return conn.execute(DIALECT.sql(sql), params).fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise _failure("read", self.where, exc) from exc

    def close(self) -> None:
        self._pool.close()


class _Transaction:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(DIALECT.sql(sql), params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(DIALECT.sql(sql), rows)


def _failure(doing: str, where: str, exc: psycopg.Error | PoolTimeout) -> StoreError:
    """The StoreError for `exc`: StoreUnreachable when the server could not be reached or the
    connection broke (no SQLSTATE, class 08, or the server shutting down), otherwise the
    server's own refusal."""
    state = getattr(exc, "sqlstate", None)
    unreachable = isinstance(exc, PoolTimeout) or (
        isinstance(exc, psycopg.OperationalError)
        and (state is None or state.startswith("08") or state.startswith("57P"))
    )
    kind = StoreUnreachable if unreachable else StoreError
    return kind(f"cannot {doing} the store {where}: {_said(exc)}")


def _said(exc: BaseException) -> str:
    """The server's words for a failure, on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
