"""The control plane's config file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from modelfleet.security.pki import is_loopback, is_wildcard


@dataclass(frozen=True)
class Heartbeats:
    """How often agents beat, and after how long a silent node is stale and lost (seconds)."""

    interval: float
    stale_after: float
    lost_after: float


class RouterTarget(BaseModel):
    """A router the control plane pushes routing snapshots to."""

    model_config = ConfigDict(extra="forbid")
    url: str  # the router's push listener, e.g. http://127.0.0.1:8081
    token: str  # the router's push_token
    # Where clients reach it (its client listener, e.g. http://127.0.0.1:8080): the
    # dashboard's Playground sends its chats there. None: not through this router.
    client_url: str | None = None


class ControlPlaneConfig(BaseModel):
    """Relative paths (`catalog`, `state_dir`) are read from the config file's folder."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    catalog: Path | None = None  # the watched catalog file; None: the catalog comes by API only
    state_dir: Path = Path("control-plane-state")  # holds the store, store.sqlite
    # The store of desired state: None, SQLite in state_dir; or a PostgreSQL database, as a
    # libpq conninfo (postgresql://user:password@host:port/db; several hosts and
    # target_session_attrs=read-write as libpq documents them).
    store: str | None = None
    host: str = "127.0.0.1"
    # TLS on the agent and admin APIs, with a certificate of the control plane's own CA (made
    # in `state_dir`/pki at its first start): "auto" serves TLS unless `host` is a loopback
    # address, "on" always; "off" is for loopback only: plain HTTP never leaves the machine.
    tls: Literal["auto", "on", "off"] = "auto"
    # The names and addresses agents, routers and operators reach the control plane by, in
    # its certificate besides `host`, 127.0.0.1 and localhost (needed when `host` is 0.0.0.0).
    tls_names: list[str] = Field(default_factory=list)
    agent_port: int = Field(default=7070, ge=0, le=65535)
    admin_port: int = Field(default=7071, ge=0, le=65535)
    admin_token: str = Field(min_length=8)
    # Takes `GET /metrics` on the admin listener besides the admin token, and nothing else:
    # for a Prometheus that should not hold the admin token.
    metrics_token: str | None = Field(default=None, min_length=16)
    # Agents join with join tokens (`ctl join-tokens create`) and report with a credential of
    # their own node. A shared agent token lets whoever holds it report as any node not joined
    # so: the mode `up` runs in, all on one machine. insecure_agent_api takes reports with no
    # credential at all (development only).
    agent_token: str | None = Field(default=None, min_length=16)
    insecure_agent_api: bool = False
    routers: list[RouterTarget] = Field(default_factory=list)
    known_nodes: list[str] = Field(default_factory=list)  # settling ends once all have reported
    settle_for: float = 0.0  # negative: no window; zero: the default; positive: that long
    reconcile_interval: float = Field(default=1.0, gt=0)
    # A pass with nothing new to plan from (no report, mark or catalog changed, no node gone
    # silent, no drain or avoidance run out) plans nothing; one in this many seconds plans anyway.
    reconcile_full_interval: float = Field(default=30.0, gt=0)
    # Heartbeats, and when a silent node is stale and lost: see `heartbeats()`, and the
    # README's "Heartbeats and lost nodes".
    heartbeat_interval: float = Field(default=2.0, gt=0)
    max_heartbeats_per_s: float = Field(default=1000.0, gt=0)
    node_stale_after: float = Field(default=10.0, gt=0)  # no word this long: nothing new lands
    # No word this long: the node is lost, and its replicas are replaced elsewhere,
    # make-before-break (an agent that was only down finds its engines unassigned and stops them).
    node_lost_after: float = Field(default=60.0, gt=0)
    # No report this long, and no replica left on it: the node is forgotten (and logged).
    node_forget_after: float = Field(default=86400.0, gt=0)
    # How often each router is asked which routing table it holds; one that holds another than
    # the current (it restarted, or missed a push) is pushed the current one at once.
    push_interval: float = Field(default=1.0, gt=0)
    # How often each router's usage counts are collected: what a router that dies loses.
    usage_interval: float = Field(default=2.0, gt=0)
    # Seconds the leader's lease lasts past each renewal (renewed every third of it), by the
    # store's clock: how long control planes sharing a store wait for a leader that died.
    lease_ttl: float = Field(default=3.0, gt=0)
    # Seconds each point of the dashboard's plots covers (`controlplane/series.py`): how often
    # the routers' numbers are read and a point per model, node and key is written to the
    # store. It divides 900 (the points of 24 h and 7 d plots are quarter hours).
    series_interval: int = Field(default=60, ge=1, le=900)
    # How often the counts of models that follow their load are decided (and at once when a
    # router's load comes: it answers every second, or when a cold model gets a request).
    autoscale_interval: float = Field(default=0.25, gt=0)
    catalog_poll_interval: float = Field(default=0.25, gt=0)
    # How long a replica taken out of service waits for every router to confirm a routing table
    # without it before its engine is stopped anyway.
    retire_timeout: float = Field(default=10.0, ge=0)
    drain_grace: float = Field(default=300.0, ge=0)  # default bound of a drain; 0: none
    # A replica whose engine failed this many times in a row is placed anew elsewhere, and its
    # model kept off that node for `failure_avoid` seconds.
    max_failures: int = Field(default=3, ge=1)
    failure_avoid: float = Field(default=600.0, ge=0)
    max_report_bytes: int = Field(default=1 << 20, gt=0)
    max_catalog_bytes: int = Field(default=1 << 20, gt=0)

    @property
    def serves_tls(self) -> bool:
        return self.tls == "on" or (self.tls == "auto" and not is_loopback(self.host))

    def certificate_names(self) -> list[str]:
        """What the control plane's certificate names: `tls_names`, `host` unless it is a
        wildcard, and this machine's loopback names."""
        names = [*self.tls_names, *([] if is_wildcard(self.host) else [self.host])]
        return list(dict.fromkeys([*names, "127.0.0.1", "localhost"]))

    @field_validator("store")
    @classmethod
    def _store_is_postgres(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError(
                "store: give a PostgreSQL URL (postgresql://user:password@host:port/db), or "
                "leave it out for SQLite in state_dir"
            )
        return value

    @model_validator(mode="after")
    def _tls_beyond_loopback(self) -> ControlPlaneConfig:
        if self.tls == "off" and not is_loopback(self.host):
            raise ValueError(
                f"tls is off but host is {self.host!r}: plain HTTP is served on loopback only "
                "(tokens would cross the network in clear); leave tls at auto or on"
            )
        if self.serves_tls and is_wildcard(self.host) and not self.tls_names:
            raise ValueError(
                f"host {self.host!r} serves TLS on every address: name in tls_names the "
                "addresses and host names agents, routers and operators reach it by, for its "
                "certificate"
            )
        return self

    @model_validator(mode="after")
    def _lost_after_stale(self) -> ControlPlaneConfig:
        if self.node_lost_after < self.node_stale_after:
            raise ValueError(
                f"node_lost_after ({self.node_lost_after}) must be at least node_stale_after "
                f"({self.node_stale_after}): a lost node's replicas must not be placed on it again"
            )
        if self.node_forget_after < self.node_lost_after:
            raise ValueError(
                f"node_forget_after ({self.node_forget_after}) must be at least node_lost_after "
                f"({self.node_lost_after}): a node is forgotten only once its replicas moved"
            )
        return self

    def heartbeats(self, nodes: int) -> Heartbeats:
        """The heartbeat interval and silences for a fleet of `nodes` nodes.

        Agents beat every `heartbeat_interval` seconds, stretched so that the whole fleet sends
        at most `max_heartbeats_per_s` (as Nomad stretches its heartbeat TTL): 10,000 nodes at
        the defaults beat every 10 s. A node silent for three intervals (at least
        `node_stale_after`) is stale, for six (at least `node_lost_after`) lost.
        """
        interval = max(self.heartbeat_interval, nodes / self.max_heartbeats_per_s)
        return Heartbeats(
            interval,
            max(self.node_stale_after, 3 * interval),
            max(self.node_lost_after, 6 * interval),
        )

    def resolve(self, folder: Path) -> ControlPlaneConfig:
        """This config with its relative paths made relative to `folder`."""
        catalog = self.catalog
        if catalog is not None and not catalog.is_absolute():
            catalog = folder / catalog
        state_dir = self.state_dir if self.state_dir.is_absolute() else folder / self.state_dir
        return self.model_copy(update={"catalog": catalog, "state_dir": state_dir})


DEFAULT_SETTLE_FOR_S = 10.0
STORE_FILE = "store.sqlite"
# In the state dir: the digest of the catalog file's content as this control plane last read it.
CATALOG_SEEN_FILE = "catalog-file.sha256"
PKI_DIR = "pki"  # in the state dir: the control plane's CA and its listeners' certificate
ROUTING_EPOCH_KEY = "routing_epoch"  # in the store: one more at every start
FLEET_CA_KEY = "fleet_ca"  # in the store: the CA every control plane on it signs with
