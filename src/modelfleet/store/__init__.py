"""The control plane's store of desired state: applied catalogs, the last rejected one, node marks,
client API keys, join tokens and node credentials, and the events of what happened.

`Store` is the seam, with two implementations that one test suite holds to it:
`SqliteStore` (`store/sqlite.py`), a file in the control plane's state dir, the embedded
default; and `PostgresStore` (`store/postgres.py`), a PostgreSQL database, which outlives any
one machine and can be shared by several control planes. Actual state (what runs where) is
never stored here: it is learned from agents' reports.

Each keeps a schema version (SCHEMA_VERSION) and brings an older schema up to it at open; a
store whose schema is newer than this modelfleet knows is refused (`check_schema`).

May import: host (files, a PostgreSQL of our own), the messages and the pure core, and the
SQLite and PostgreSQL drivers; only the control plane (and the command that starts it)
uses it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from modelfleet.core.fleet import REPLICA_ID_DIGITS

# The schema this modelfleet writes. One more with every change to the tables; each
# implementation has one migration per version.
SCHEMA_VERSION = 8

# A change's request id is kept this long: no client retries one that old.
REQUEST_MEMORY_S = 86400.0


@dataclass(frozen=True)
class StoredCatalog:
    """One applied catalog version, as it was applied."""

    version: int
    digest: str
    applied_at: float  # wall-clock seconds (time.time())
    source: str  # "api" or the path of the catalog file
    body: dict[str, Any]  # Catalog.to_dict(): what Catalog.from_dict reads back as equal
    text: str | None = None  # the file or request it was applied from (None: before schema 4)


@dataclass(frozen=True)
class Rejection:
    """A catalog that was refused: when, from where, and every problem found."""

    at: float
    source: str
    problems: tuple[str, ...]


@dataclass(frozen=True)
class StoredMark:
    """An operator's mark on a node (never "none": an unmarked node has no row)."""

    node: str
    mark: str  # a fleet.Mark value
    since: float  # wall-clock seconds
    drain_deadline: float | None  # wall-clock seconds; only for "draining", None: no bound


@dataclass(frozen=True)
class EventScope:
    """Which events a read takes: those regarding any of `objects` (each one object,
    "node/gpu-1", or a kind, "node"), any object named one of `families` and then
    FAMILY_TAIL characters (a model's replicas: "replica/chat-" and a replica id's hex
    digits), and the events about a replica's shard on node `shards_on` (their message
    begins "shard N on NODE", as `report_news` words it)."""

    objects: tuple[str, ...] = ()
    families: tuple[str, ...] = ()
    shards_on: str | None = None


FAMILY_TAIL = REPLICA_ID_DIGITS


@dataclass(frozen=True)
class StoredKey:
    """A client API key the control plane manages: its SHA-256, never the key."""

    name: str
    sha256: str
    prefix: str  # the key's first characters, to tell keys apart in a list
    models: tuple[str, ...] | None  # the models it may use; None: all
    rpm: int | None  # requests per minute; None: no limit
    tpm: int | None  # tokens per minute (prompt + completion)
    max_concurrent: int | None
    created_at: float  # wall-clock seconds
    expires_at: float | None  # wall-clock seconds; None: never


@dataclass(frozen=True)
class StoredUsage:
    """What one key did with one model in one hour, summed over every router."""

    key: str
    model: str
    hour: int  # wall-clock seconds at the start of the hour
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    last_at: float


@dataclass(frozen=True)
class StoredPoint:
    """What one thing (a model, a node, a key) counted over one step of time: the points the
    dashboard plots (`controlplane/series.py`), kept so that plots outlive a restart."""

    kind: str  # "model", "node" or "key"
    subject: str  # its name
    step: int  # the seconds it covers
    at: int  # wall-clock seconds at its start: a multiple of `step`
    body: str  # JSON: its sums, as `series.Totals` writes them


@dataclass(frozen=True)
class StoredJoinToken:
    """A join token (`joining.py`): its id and the SHA-256 of its secret, never the secret."""

    id: str
    sha256: str
    created_at: float  # wall-clock seconds
    expires_at: float | None  # wall-clock seconds; None: never
    uses_left: int | None  # None: any number
    used: int = 0
    # Addresses the operator lets a node joining with it advertise (and its certificate
    # name) besides the one it joins from.
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class StoredCredential:
    """A node's credential: the SHA-256 of it, and the join token it was given for."""

    node: str
    sha256: str
    issued_at: float  # wall-clock seconds
    token_id: str
    # The addresses the node may advertise (where it joined from); None: a credential given
    # before they were kept (schema version 6), whose node's address is not checked.
    addresses: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Once:
    """A change's request id (an admin request's `Idempotency-Key`), recorded in the same
    transaction as the change: whether it landed has one answer, the store's, whoever asks
    (a control plane elected after a failover too). `route` says what was asked (`PUT
    /v1/catalog`), `outcome` what the change did (JSON: the write adds what only it knows,
    a catalog's version)."""

    id: str
    route: str
    outcome: dict[str, Any]


@dataclass(frozen=True)
class StoredRequest:
    """A change made once by its request id (`Once`), as recorded with it."""

    id: str
    route: str
    outcome: dict[str, Any]
    at: float  # the store's clock when it was made


@dataclass(frozen=True)
class StoredEvent:
    """Something that happened, shaped like a Kubernetes event: a repeat of the last event
    about the same object (same reason and message) counts up instead of adding one."""

    id: int
    type: str  # "normal" or "warning"
    reason: str  # what happened, in one CamelCase word: CatalogApplied, ShardFailed, ...
    regarding: str  # what it is about, KIND/NAME: node/gpu-1, replica/chat-1a2b3c, model/chat
    message: str
    count: int
    first_at: float  # wall-clock seconds
    last_at: float
    source: str  # the process that saw it: control-plane


@dataclass(frozen=True)
class EventWrite:
    """One event to write: a new one (`id` None; the event's own id is ignored), or one that
    happened again (`id` its row: its count and last time are written)."""

    event: StoredEvent
    id: int | None = None


@dataclass(frozen=True)
class Lease:
    """The control planes' lease: who leads, under which epoch, for how much longer.

    Times are the store's own (the database server's clock), never a control plane's: two
    hosts' clocks need not agree for one to take the lease only once the other's ran out."""

    holder: str  # "" when nobody has held it yet
    epoch: int  # one more at every change of holder: the fencing token
    remaining_s: float  # until it runs out, by the store's clock; <= 0: it has run out
    # The store's clock as it read the lease, in seconds since the epoch: the one clock every
    # control plane on the store shares, for the times they write (expiries).
    store_now: float = 0.0
    # The process that holds it (`controlplane/leadership.py`'s `Process`, as text): a holder
    # name is its state dir's, and a copied state dir must not make two processes one holder.
    process: str = ""


@dataclass(frozen=True)
class SeenControlPlane:
    """A control plane on this store, as it last said it was alive (`Store.see_control_plane`).
    `seen_ago_s` is by the store's clock, like the lease's times."""

    name: str  # its holder name in the lease
    agent_url: str  # where agents reach it
    admin_url: str  # where operators (ctl, the dashboard) reach it
    seen_ago_s: float


class StoreError(RuntimeError):
    """The store could not be opened or written; the message names the file and the cause.
    A write that fails changes nothing."""


class StoreUnreachable(StoreError):
    """The store could not be reached, or did not answer in time, and calls are refused at
    once until it answers again (`store/calls.py`). Nothing was changed, unless it is an
    `OutcomeUnknown`."""


class OutcomeUnknown(StoreUnreachable):
    """A call sent to the store whose outcome is not known: it did not answer in time (a
    write may still commit later), or the connection broke while it committed. A read changed
    nothing either way; a write is never answered "nothing was changed": it may have been
    made. Its request id (`Once`) says which, once the store answers again."""


class AlreadyMade(StoreError):
    """A write refused because its request id was recorded before: the change was made
    once, by an earlier attempt (`request` says what it did). Nothing was changed now."""

    def __init__(self, request: StoredRequest) -> None:
        super().__init__(f"request {request.id} was made before ({request.route})")
        self.request = request


class Fenced(StoreError):
    """A write refused because this control plane's lease epoch is no longer the store's:
    another took the lease, and this one must stop acting."""


def check_schema(found: int, where: str) -> None:
    """Refuse a store whose schema is newer than this modelfleet knows (a newer control plane
    has written it): reading it could misread, writing it could break the newer one."""
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"the store {where} has schema version {found}, newer than this modelfleet knows "
            f"(up to {SCHEMA_VERSION}): run the newer modelfleet, or a store of its own"
        )


def fenced_message(mine: int, current: int, holder: str) -> str:
    return (
        f"write refused: this control plane leads under epoch {mine}, but the store's lease "
        f"is at epoch {current}, held by {holder or 'nobody'}; it has stopped leading"
    )


class WriteHealth:
    """Whether the store's writes work: the failures in a row, since when, and the last
    error, for `Store.write_problem`."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._failed = 0
        self._since = 0.0
        self._error = ""

    def wrote(self, error: BaseException | None) -> None:
        if error is None:
            self._failed = 0
            return
        if not self._failed:
            self._since = time.time()
        self._failed += 1
        self._error = str(error).strip()

    def problem(self) -> str | None:
        if not self._failed:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._since))
        return (
            f"the store {self.where} cannot write: {self._error} "
            f"({self._failed} write(s) failed since {since}; retried, nothing lost)"
        )


class Store(Protocol):
    """Durable desired state. Every call is a small, synchronous, committed transaction;
    a write that fails raises StoreError and changes nothing."""

    where: str  # the store, for messages: a file, or a database without its password

    def write_problem(self) -> str | None:
        """Why the last write failed, while no write has succeeded since (a full disk, a
        file made read-only), with how many failed and since when; None while writes work."""
        ...

    def add_catalog(
        self,
        digest: str,
        applied_at: float,
        source: str,
        body: dict[str, Any],
        text: str | None = None,
        once: Once | None = None,
    ) -> int:
        """Record a newly applied catalog (and the `text` it was applied from); returns its
        version, one more than the last (added to `once`'s outcome as "version")."""
        ...

    def latest_catalog(self) -> StoredCatalog | None: ...

    def catalog_history(self, limit: int) -> list[StoredCatalog]:
        """The last `limit` versions, newest first."""
        ...

    def set_rejection(self, rejection: Rejection) -> None: ...

    def last_rejection(self) -> Rejection | None: ...

    def set_mark(self, mark: StoredMark, once: Once | None = None) -> None:
        """Record a node's mark, replacing the one it had."""
        ...

    def clear_mark(self, node: str, once: Once | None = None) -> None: ...

    def marks(self) -> list[StoredMark]: ...

    def get_meta(self, key: str) -> str | None: ...

    def set_meta(self, key: str, value: str) -> None: ...

    def put_meta_once(self, key: str, value: str) -> str:
        """Set `key` to `value` unless it has a value already; returns the value it has now
        (of whichever control plane set it first). Never fenced."""
        ...

    def put_key(self, key: StoredKey, once: Once | None = None) -> None:
        """Record a key, replacing the one of the same name."""
        ...

    def delete_key(self, name: str, once: Once | None = None) -> None: ...

    def request(self, request_id: str) -> StoredRequest | None:
        """The change made with this request id (`Once`), if one was (kept for
        REQUEST_MEMORY_S)."""
        ...

    def api_keys(self) -> list[StoredKey]:
        """Every key, by name."""
        ...

    def put_join_token(self, token: StoredJoinToken) -> None:
        """Record a join token, replacing the one of the same id."""
        ...

    def delete_join_token(self, token_id: str) -> None: ...

    def join_tokens(self) -> list[StoredJoinToken]:
        """Every join token, oldest first."""
        ...

    def record_join(self, token: StoredJoinToken, credential: StoredCredential) -> None:
        """In one transaction: the token as its use left it, and the node's new credential
        (replacing one the node had)."""
        ...

    def revoke_node(self, node: str, at: float) -> None:
        """In one transaction: delete `node`'s credential (if it has one) and keep that its
        name was revoked at `at` (wall-clock seconds): no join token made then or before
        joins it again."""
        ...

    def revoked_nodes(self) -> dict[str, float]:
        """Every node name revoked (or deleted), and when it last was."""
        ...

    def credentials(self) -> list[StoredCredential]:
        """Every node's credential, by node."""
        ...

    def write_events(
        self, writes: Sequence[EventWrite], keep: int, fenced: bool = True
    ) -> list[int]:
        """In one transaction, record new events and count up those that happened again;
        returns each one's id, in order. The oldest go once more than `keep` are kept. Not
        `fenced`: written whoever leads (a leader saying it lost the lease)."""
        ...

    def events(
        self,
        regarding: str | EventScope | None = None,
        since: float = 0.0,
        after: int = 0,
        limit: int = 1000,
    ) -> list[StoredEvent]:
        """Events last seen from `since` on with an id above `after`, in the order they were
        last seen (oldest first), at most `limit` (the last seen of them); `regarding`
        "node/gpu-1" for one object, "node" for a kind, an EventScope for several."""
        ...

    def add_usage(self, run: str, batch: int, rows: list[StoredUsage], now: float) -> bool:
        """Add a router's batch of counts, once: False when (run, batch) was added before."""
        ...

    def usage(
        self, key: str | None = None, model: str | None = None, since: int = 0
    ) -> list[StoredUsage]:
        """The counts of hours from `since` on, by hour, key and model."""
        ...

    def usage_totals(self) -> dict[str, tuple[int, int, float]]:
        """Every key's usage so far: key -> (requests, tokens, when it was last used)."""
        ...

    def put_points(self, points: Sequence[StoredPoint], forget: Mapping[int, float]) -> None:
        """Write `points`, each replacing the one of the same kind, subject, step and time;
        forget the points of each step in `forget` that begin before the time it gives."""
        ...

    def points(
        self, kind: str | None, subject: str | None, step: int, since: float
    ) -> list[StoredPoint]:
        """The points of one step beginning at `since` or later, by time; `kind` and
        `subject` None: of every kind or subject."""
        ...

    def take_lease(
        self, holder: str, ttl_s: float, process: str = "", replacing: str = ""
    ) -> Lease:
        """Take the lease for `holder` in `process` when nobody holds it or it has run out
        (the epoch one more when the holder or its process changes), or renew it when
        `holder` holds it in `process` (or in `replacing`: a process of the same holder known
        to have exited, whose lease it takes over at once under the same epoch), for `ttl_s`
        by the store's clock; otherwise leave it. Returns the lease as it is now."""
        ...

    def release_lease(self, holder: str) -> None:
        """Let the lease run out now, if `holder` holds it (an orderly stop)."""
        ...

    def lease(self) -> Lease: ...

    def see_control_plane(self, name: str, agent_url: str, admin_url: str) -> None:
        """`name` is alive now and reached at these URLs (every control plane says so at each
        lease renewal, leader or not; never fenced)."""
        ...

    def control_planes(self) -> list[SeenControlPlane]:
        """Every control plane that ever said it was alive on this store, by name."""
        ...

    def fence(self, epoch: int | None) -> None:
        """From now on every write checks, in its own transaction, that the lease's epoch is
        still `epoch` (None: no check), and is refused with Fenced when it is not."""
        ...

    def close(self) -> None: ...
