"""What `modelfleet up` keeps across its restarts on one state dir: the client API key, the
admin and agent tokens, the ports of the router and the control plane, and where the
router's limits count (`--limits-store URL`, or `--redis`: a Redis server `up` runs, and its
password).

A client configured against yesterday's `up` still reaches the router today with the same
key at the same URL. A kept port that something else holds now is replaced by a free one, and
`up` says so: the fleet starts rather than failing, and the operator learns what moved.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelfleet.host.files import write_atomic
from modelfleet.host.processes import free_port
from modelfleet.security.apikeys import new_key
from modelfleet.up.children import UpError

KEPT_FILE = "up-kept.json"
HOST = "127.0.0.1"


class KeptError(UpError):
    """The kept file cannot be read; nothing was started and nothing was overwritten."""


class Kept(BaseModel):
    """The credentials and ports of the fleet on one state dir."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key: str = Field(min_length=1)
    admin_token: str = Field(min_length=1)
    agent_token: str = Field(min_length=1)
    router_port: int = Field(gt=0, lt=65536)
    push_port: int = Field(gt=0, lt=65536)
    agent_port: int = Field(gt=0, lt=65536)
    admin_port: int = Field(gt=0, lt=65536)
    limits_store: str | None = None  # a Redis URL the router counts keys' limits in
    redis_port: int | None = Field(default=None, gt=0, lt=65536)  # set: `up` runs Redis there
    # That Redis's password (its `requirepass`); made with its port, kept as long as it is.
    redis_password: str | None = None
    # The control planes' store: None, SQLite in the control plane's state dir; "postgres",
    # a PostgreSQL `up` runs in the state dir on `postgres_port`; or a PostgreSQL URL.
    store: str | None = None
    postgres_port: int | None = Field(default=None, gt=0, lt=65536)
    # The agent and admin ports of the control planes after the first, kept like its own.
    more_control_planes: list[tuple[int, int]] = Field(default_factory=list)

    @property
    def limits_url(self) -> str | None:
        """Where the router counts keys' limits: the Redis `up` runs, the URL given, or its
        own memory (None)."""
        if self.redis_port is not None:
            return f"redis://:{self.redis_password}@{HOST}:{self.redis_port}/0"
        return self.limits_store


@dataclass(frozen=True)
class Loaded:
    kept: Kept
    notes: list[str]  # what changed since the last `up`, for the operator


def port_free(port: int, host: str = HOST) -> bool:
    """Whether a listener could bind `port` now (SO_REUSEADDR, as ours do, so a port in
    TIME_WAIT from the fleet just stopped counts as free)."""
    with socket.socket(socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def load_or_make(
    state_dir: Path,
    router_port: int = 0,
    limits_store: str | None = None,
    redis: bool | None = None,
    held: frozenset[str] = frozenset(),
    store: str | None = None,
    control_planes: int = 1,
) -> Loaded:
    """The kept credentials and ports of `state_dir`, made and saved on the first `up`.

    `router_port`, when given, is where the router listens from now on. `limits_store` (a
    Redis URL; "" for none) and `redis` (run one), when given, are where the router counts
    keys' limits from now on; left out, the last `up`'s choice stands; so does `store` ("sqlite",
    "postgres" or a PostgreSQL URL). `control_planes` have ports kept. Raises KeptError when
    the file exists but cannot be read: making new credentials over it would lock out every
    client of the old ones without a word. Ports named in `held` are held by a process of
    the last `up` that this one may adopt: they are kept even though they are taken.
    """
    if redis and limits_store:
        raise KeptError("give --redis or --limits-store, not both: the router counts in one")
    path = state_dir / KEPT_FILE
    notes: list[str] = []
    try:
        kept: Kept | None = Kept.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        kept = None
    except (OSError, ValidationError) as exc:
        raise KeptError(
            f"cannot read {path} ({str(exc).splitlines()[0]}); it holds the API key and tokens "
            "of this state dir's fleet: fix it, or delete it to make new ones"
        ) from exc
    if kept is None:
        kept = Kept(
            api_key=new_key(),
            admin_token=secrets.token_urlsafe(24),
            agent_token=secrets.token_urlsafe(24),
            router_port=router_port or free_port(HOST, "services"),
            push_port=free_port(HOST, "services"),
            agent_port=free_port(HOST, "services"),
            admin_port=free_port(HOST, "services"),
        )
    else:
        moved: dict[str, int] = {}
        if router_port and router_port != kept.router_port:
            moved["router_port"] = router_port
        for name in ("router_port", "push_port", "agent_port", "admin_port"):
            port = moved.get(name, getattr(kept, name))
            if name in held and name not in moved:
                continue
            if not port_free(port):
                if name == "router_port" and router_port:
                    continue  # asked for by the operator: the router's own error names it
                moved[name] = free_port(HOST, "services")
                notes.append(
                    f"{name.replace('_', ' ')} {port} is taken now; using {moved[name]} instead"
                )
        kept = kept.model_copy(update=moved)
    if limits_store is not None:
        kept = kept.model_copy(update={"limits_store": limits_store or None, "redis_port": None})
    if redis is not None:
        port = kept.redis_port or free_port(HOST, "services") if redis else None
        kept = kept.model_copy(update={"redis_port": port})
        if redis:
            kept = kept.model_copy(update={"limits_store": None})
    # A Redis `up` runs has a password (one kept from before the password was: given one now).
    if kept.redis_port is None:
        kept = kept.model_copy(update={"redis_password": None})
    elif not kept.redis_password:
        kept = kept.model_copy(update={"redis_password": secrets.token_urlsafe(24)})
    if store is not None:
        if store not in ("sqlite", "postgres") and not store.startswith(
            ("postgresql://", "postgres://")
        ):
            raise KeptError(
                f"--store {store!r}: give sqlite, postgres (one `up` runs in the state dir) or "
                "a PostgreSQL URL (postgresql://user:password@host:port/db)"
            )
        chosen = None if store == "sqlite" else store
        if kept.store != chosen and path.exists():
            notes.append(
                f"the control planes' store is {_store_words(chosen)} now (it was "
                f"{_store_words(kept.store)}): keys, marks and catalog history start anew there"
            )
        kept = kept.model_copy(update={"store": chosen})
    if kept.store == "postgres" and kept.postgres_port is None:
        kept = kept.model_copy(update={"postgres_port": free_port(HOST, "services")})
    more = [tuple(p) for p in kept.more_control_planes[: max(0, control_planes - 1)]]
    while len(more) < control_planes - 1:
        more.append((free_port(HOST, "services"), free_port(HOST, "services")))
    kept = kept.model_copy(update={"more_control_planes": more})
    write_atomic(path, kept.model_dump_json(indent=2))
    return Loaded(kept, notes)


def _store_words(store: str | None) -> str:
    if store is None:
        return "SQLite in the control plane's state dir"
    if store == "postgres":
        return "the PostgreSQL `up` runs in the state dir"
    return "a PostgreSQL of your own"
