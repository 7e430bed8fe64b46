"""The store in a PostgreSQL database (`store: postgresql://...` in the control plane's config).

psycopg 3 with a small connection pool. The conninfo is libpq's, so several hosts and
`target_session_attrs=read-write` work as libpq documents them: after a failover the pool's
next connection goes to the new primary. Each call is one transaction; a failed one (the
server gone, a full disk) raises StoreError and changed nothing.

The schema is versioned (a `schema_version` table) and brought up to SCHEMA_VERSION at open
under `pg_advisory_xact_lock`, so that two control planes starting together never migrate at
once; a schema newer than this modelfleet knows is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from modelfleet.pgserver import redacted
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

__all__ = ["PostgresStore"]

# A batch seen longer ago than this is forgotten: no router resends one that old.
_BATCH_MEMORY_S = 86400.0
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
}
# The store's clock: the database server's, in seconds since the epoch.
_NOW = "extract(epoch from clock_timestamp())::double precision"


class PostgresStore:
    """`Store` on PostgreSQL at `conninfo` (a libpq URL or key=value string)."""

    def __init__(self, conninfo: str, pool_size: int = 4, timeout: float = 10.0) -> None:
        self.where = redacted(conninfo)
        self.health = WriteHealth(self.where)
        self.fenced_epoch: int | None = None  # see `fence`
        try:
            self._pool = ConnectionPool(
                conninfo,
                min_size=1,
                max_size=pool_size,
                timeout=timeout,
                kwargs={"autocommit": True, "connect_timeout": int(timeout)},
                check=ConnectionPool.check_connection,
                open=False,
            )
            self._pool.open(wait=True, timeout=timeout)
            self._migrate()
        except (psycopg.Error, PoolTimeout) as exc:
            raise StoreError(f"cannot open the store {self.where}: {_said(exc)}") from exc

    def _migrate(self) -> None:
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            found = int(row[0]) if row and row[0] is not None else 0
            check_schema(found, self.where)
            for version in range(found + 1, SCHEMA_VERSION + 1):
                conn.execute(MIGRATIONS[version])
                conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))

    # -- the seam ---------------------------------------------------------------------------

    @contextmanager
    def _write(self, fenced: bool = True) -> Iterator[psycopg.Connection[Any]]:
        """One transaction that writes; any failure is a StoreError and changed nothing.
        Fenced (`fence`), it first checks the lease's epoch, holding the lease row shared
        until it commits: a new leader's take waits for it, and every write after the take
        is refused."""
        epoch = self.fenced_epoch if fenced else None
        try:
            with self._pool.connection() as conn, conn.transaction():
                if epoch is not None:
                    row = conn.execute(
                        "SELECT holder, epoch FROM lease WHERE id = 1 FOR SHARE"
                    ).fetchone()
                    assert row is not None
                    if int(row[1]) != epoch:
                        raise Fenced(fenced_message(epoch, int(row[1]), row[0]))
                yield conn
        except (psycopg.Error, PoolTimeout) as exc:
            self.health.wrote(exc)
            raise StoreError(f"cannot write the store {self.where}: {_said(exc)}") from exc
        self.health.wrote(None)

    def _read(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[Any]:
        try:
            with self._pool.connection() as conn:
                return conn.execute(sql, params).fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise StoreError(f"cannot read the store {self.where}: {_said(exc)}") from exc

    def write_problem(self) -> str | None:
        return self.health.problem()

    def close(self) -> None:
        self._pool.close()

    # -- the lease -------------------------------------------------------------------------

    def take_lease(self, holder: str, ttl_s: float) -> Lease:
        with self._write(fenced=False) as conn:
            row = conn.execute(
                f"SELECT holder, epoch, expires_at, {_NOW} FROM lease WHERE id = 1 FOR UPDATE"
            ).fetchone()
            assert row is not None
            held, epoch, expires_at, now = row[0], int(row[1]), row[2], row[3]
            if held == holder or expires_at <= now:
                epoch = epoch if held == holder else epoch + 1
                held, expires_at = holder, now + ttl_s
                conn.execute(
                    "UPDATE lease SET holder = %s, epoch = %s, expires_at = %s WHERE id = 1",
                    (held, epoch, expires_at),
                )
        return Lease(held, epoch, expires_at - now)

    def release_lease(self, holder: str) -> None:
        with self._write(fenced=False) as conn:
            conn.execute(
                f"UPDATE lease SET expires_at = {_NOW} WHERE id = 1 AND holder = %s", (holder,)
            )

    def lease(self) -> Lease:
        rows = self._read(f"SELECT holder, epoch, expires_at, {_NOW} FROM lease WHERE id = 1")
        held, epoch, expires_at, now = rows[0]
        return Lease(held, int(epoch), expires_at - now)

    def see_control_plane(self, name: str, agent_url: str, admin_url: str) -> None:
        with self._write(fenced=False) as conn:
            conn.execute(
                "INSERT INTO control_planes (name, agent_url, admin_url, seen_at) "
                f"VALUES (%s, %s, %s, {_NOW}) ON CONFLICT (name) DO UPDATE SET "
                "agent_url = excluded.agent_url, admin_url = excluded.admin_url, "
                "seen_at = excluded.seen_at",
                (name, agent_url, admin_url),
            )

    def control_planes(self) -> list[SeenControlPlane]:
        rows = self._read(
            f"SELECT name, agent_url, admin_url, {_NOW} - seen_at FROM control_planes ORDER BY name"
        )
        return [SeenControlPlane(*row) for row in rows]

    def fence(self, epoch: int | None) -> None:
        self.fenced_epoch = epoch

    # -- catalogs, marks, meta --------------------------------------------------------------

    def add_catalog(self, digest: str, applied_at: float, source: str, body: dict[str, Any]) -> int:
        with self._write() as conn:
            conn.execute("LOCK TABLE catalogs IN EXCLUSIVE MODE")
            row = conn.execute(
                "INSERT INTO catalogs (version, digest, applied_at, source, body) "
                "VALUES ((SELECT COALESCE(MAX(version), 0) + 1 FROM catalogs), %s, %s, %s, %s) "
                "RETURNING version",
                (digest, applied_at, source, json.dumps(body, sort_keys=True)),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def latest_catalog(self) -> StoredCatalog | None:
        rows = self.catalog_history(1)
        return rows[0] if rows else None

    def catalog_history(self, limit: int) -> list[StoredCatalog]:
        rows = self._read(
            "SELECT version, digest, applied_at, source, body FROM catalogs "
            "ORDER BY version DESC LIMIT %s",
            (limit,),
        )
        return [StoredCatalog(int(v), d, a, s, json.loads(b)) for v, d, a, s, b in rows]

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
        with self._write() as conn:
            conn.execute(
                "INSERT INTO node_marks (node, mark, since, drain_deadline) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (node) DO UPDATE SET mark = excluded.mark, "
                "since = excluded.since, drain_deadline = excluded.drain_deadline",
                (mark.node, mark.mark, mark.since, mark.drain_deadline),
            )

    def clear_mark(self, node: str) -> None:
        with self._write() as conn:
            conn.execute("DELETE FROM node_marks WHERE node = %s", (node,))

    def marks(self) -> list[StoredMark]:
        rows = self._read("SELECT node, mark, since, drain_deadline FROM node_marks ORDER BY node")
        return [StoredMark(*row) for row in rows]

    def get_meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = %s", (key,))
        return str(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: str) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (%s, %s) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    # -- keys, join tokens, credentials ----------------------------------------------------

    def put_meta_once(self, key: str, value: str) -> str:
        with self._write(fenced=False) as conn:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
                (key, value),
            )
        kept = self.get_meta(key)
        assert kept is not None
        return kept

    def put_key(self, key: StoredKey) -> None:
        models = json.dumps(list(key.models)) if key.models is not None else None
        with self._write() as conn:
            conn.execute(
                "INSERT INTO api_keys (name, sha256, prefix, models, rpm, tpm, max_concurrent, "
                "created_at, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (name) DO UPDATE SET sha256 = excluded.sha256, "
                "prefix = excluded.prefix, models = excluded.models, rpm = excluded.rpm, "
                "tpm = excluded.tpm, max_concurrent = excluded.max_concurrent, "
                "created_at = excluded.created_at, expires_at = excluded.expires_at",
                (key.name, key.sha256, key.prefix, models, key.rpm, key.tpm,
                 key.max_concurrent, key.created_at, key.expires_at),
            )  # fmt: skip

    def delete_key(self, name: str) -> None:
        with self._write() as conn:
            conn.execute("DELETE FROM api_keys WHERE name = %s", (name,))

    def api_keys(self) -> list[StoredKey]:
        rows = self._read(
            "SELECT name, sha256, prefix, models, rpm, tpm, max_concurrent, created_at, "
            "expires_at FROM api_keys ORDER BY name"
        )
        return [
            StoredKey(n, s, p, tuple(json.loads(m)) if m is not None else None, *rest)
            for n, s, p, m, *rest in rows
        ]

    def put_join_token(self, token: StoredJoinToken) -> None:
        with self._write() as conn:
            _put_join_token(conn, token)

    def delete_join_token(self, token_id: str) -> None:
        with self._write() as conn:
            conn.execute("DELETE FROM join_tokens WHERE id = %s", (token_id,))

    def join_tokens(self) -> list[StoredJoinToken]:
        rows = self._read(
            "SELECT id, sha256, created_at, expires_at, uses_left, used FROM join_tokens "
            "ORDER BY created_at, id"
        )
        return [StoredJoinToken(*row) for row in rows]

    def record_join(self, token: StoredJoinToken, credential: StoredCredential) -> None:
        c = credential
        with self._write() as conn:
            _put_join_token(conn, token)
            conn.execute(
                "INSERT INTO node_credentials (node, sha256, issued_at, token_id) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (node) DO UPDATE SET "
                "sha256 = excluded.sha256, issued_at = excluded.issued_at, "
                "token_id = excluded.token_id",
                (c.node, c.sha256, c.issued_at, c.token_id),
            )

    def delete_credential(self, node: str) -> None:
        with self._write() as conn:
            conn.execute("DELETE FROM node_credentials WHERE node = %s", (node,))

    def credentials(self) -> list[StoredCredential]:
        rows = self._read(
            "SELECT node, sha256, issued_at, token_id FROM node_credentials ORDER BY node"
        )
        return [StoredCredential(*row) for row in rows]

    # -- events ----------------------------------------------------------------------------

    def add_event(self, event: StoredEvent, keep: int) -> int:
        e = event
        with self._write() as conn:
            row = conn.execute(
                "INSERT INTO events (type, reason, regarding, message, count, first_at, "
                "last_at, source) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                (e.type, e.reason, e.regarding, e.message, e.count, e.first_at, e.last_at,
                 e.source),
            ).fetchone()  # fmt: skip
            assert row is not None
            new = int(row[0])
            conn.execute("DELETE FROM events WHERE id <= %s", (new - keep,))
        return new

    def repeat_event(self, event_id: int, count: int, at: float) -> None:
        with self._write() as conn:
            conn.execute(
                "UPDATE events SET count = %s, last_at = %s WHERE id = %s", (count, at, event_id)
            )

    def events(
        self, regarding: str | None = None, since: float = 0.0, after: int = 0, limit: int = 1000
    ) -> list[StoredEvent]:
        kind = regarding if regarding is not None and "/" not in regarding else None
        one = regarding if regarding is not None and "/" in regarding else None
        rows = self._read(
            "SELECT id, type, reason, regarding, message, count, first_at, last_at, source "
            "FROM events WHERE last_at >= %(since)s AND id > %(after)s "
            "AND (%(one)s::text IS NULL OR regarding = %(one)s) "
            "AND (%(kind)s::text IS NULL OR starts_with(regarding, %(kind)s || '/')) "
            "ORDER BY id DESC LIMIT %(limit)s",
            {"since": since, "after": after, "one": one, "kind": kind, "limit": limit},
        )
        return [StoredEvent(int(i), t, r, g, m, int(c), *rest) for i, t, r, g, m, c, *rest in
                reversed(rows)]  # fmt: skip

    # -- usage -----------------------------------------------------------------------------

    def add_usage(self, run: str, batch: int, rows: list[StoredUsage], now: float) -> bool:
        with self._write() as conn:
            seen = conn.execute(
                "INSERT INTO usage_batches (run, batch, at) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING",
                (run, batch, now),
            )
            if seen.rowcount == 0:
                return False
            with conn.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO usage (key, model, hour, requests, prompt_tokens, "
                    "completion_tokens, errors, last_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (key, model, hour) DO UPDATE SET "
                    "requests = usage.requests + excluded.requests, "
                    "prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens, "
                    "completion_tokens = usage.completion_tokens + excluded.completion_tokens, "
                    "errors = usage.errors + excluded.errors, "
                    "last_at = GREATEST(usage.last_at, excluded.last_at)",
                    [(r.key, r.model, r.hour, r.requests, r.prompt_tokens, r.completion_tokens,
                      r.errors, r.last_at) for r in rows],
                )  # fmt: skip
            conn.execute("DELETE FROM usage_batches WHERE at < %s", (now - _BATCH_MEMORY_S,))
        return True

    def usage(
        self, key: str | None = None, model: str | None = None, since: int = 0
    ) -> list[StoredUsage]:
        rows = self._read(
            "SELECT key, model, hour, requests, prompt_tokens, completion_tokens, errors, "
            "last_at FROM usage WHERE hour >= %(since)s "
            "AND (%(key)s::text IS NULL OR key = %(key)s) "
            "AND (%(model)s::text IS NULL OR model = %(model)s) ORDER BY hour, key, model",
            {"since": since, "key": key, "model": model},
        )
        return [StoredUsage(k, m, int(h), int(r), int(p), int(c), int(e), at)
                for k, m, h, r, p, c, e, at in rows]  # fmt: skip

    def usage_totals(self) -> dict[str, tuple[int, int, float]]:
        rows = self._read(
            "SELECT key, SUM(requests), SUM(prompt_tokens + completion_tokens), MAX(last_at) "
            "FROM usage GROUP BY key"
        )
        return {key: (int(requests), int(tokens), last) for key, requests, tokens, last in rows}


def _put_join_token(conn: psycopg.Connection[Any], t: StoredJoinToken) -> None:
    conn.execute(
        "INSERT INTO join_tokens (id, sha256, created_at, expires_at, uses_left, used) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
        "sha256 = excluded.sha256, created_at = excluded.created_at, "
        "expires_at = excluded.expires_at, uses_left = excluded.uses_left, used = excluded.used",
        (t.id, t.sha256, t.created_at, t.expires_at, t.uses_left, t.used),
    )


def _said(exc: BaseException) -> str:
    """The server's words for a failure, on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
