"""The messages on the wire: the one schema both ends of every connection import.

Agent -> control plane: `AgentReport` (the node's whole state) when it changed, `Heartbeat`
otherwise, answered by `NodeAssignment` (the node's whole desired shard set). Control plane ->
router: `RoutingSnapshot`, whole and
versioned. Every exchange is level-triggered, so a lost or repeated message heals on the next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOG_TAIL_LINES = 200
# A node's name as a join gives it: what a host name, a label or a file name may hold.
NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuReport(_Message):
    index: int = Field(ge=0)
    model: str
    memory_total: int = Field(ge=0)
    memory_used: int = Field(ge=0)
    healthy: bool = True
    reason: str = ""
    # The share of time a kernel ran, in %, as NVML counts it; None where the GPU does not
    # say (CPU slots). Plotted, never placed by: a change of it alone sends no report.
    utilization: float | None = Field(default=None, ge=0, le=100)


class NodeUse(_Message):
    """A node's GPUs as sampled now, summed: their memory in use and in all, and their mean
    utilisation (of those that say it; None: none does). Each heartbeat carries it for the
    dashboard's plots of the node (`controlplane/series.py`); placement reads reports only."""

    memory_used: int = Field(ge=0)
    memory_total: int = Field(ge=0)
    utilization: float | None = Field(default=None, ge=0, le=100)

    @classmethod
    def of(cls, gpus: Sequence[GpuReport]) -> NodeUse:
        said = [g.utilization for g in gpus if g.utilization is not None]
        return cls(
            memory_used=sum(g.memory_used for g in gpus),
            memory_total=sum(g.memory_total for g in gpus),
            utilization=sum(said) / len(said) if said else None,
        )


class ShardState(StrEnum):
    STARTING = "starting"  # the engine process runs but has not answered its health check
    READY = "ready"
    FAILED = "failed"  # exited or never became ready; restarted after a backoff
    STOPPING = "stopping"  # no longer assigned; finishing in-flight requests
    SLEEPING = "sleeping"  # its engine runs with its GPU memory freed, until told to wake


class AdapterState(StrEnum):
    LOADING = "loading"  # asked of the engine, or to be asked again after a failed try
    LOADED = "loaded"  # the engine holds it: requests for it may go there
    FAILED = "failed"  # the engine refused it `tries` times; not asked again until it changes


class AdapterReport(_Message):
    """One LoRA adapter a shard's engine should hold, as its agent last saw it."""

    name: str
    state: AdapterState
    tries: int = Field(default=0, ge=0)  # loads asked of this engine process that failed
    error: str = Field(default="", max_length=1000)  # the engine's own words for the last


class ShardReport(_Message):
    replica_id: str
    model: str
    rank: int = Field(ge=0)
    num_shards: int = Field(ge=1)
    gpus: list[int]
    engine_digest: str
    state: ShardState
    port: int | None = None
    # Its port serves TLS with the node's certificate, to the fleet's routers only (the
    # engine's gate, `agent/gate.py`): routers reach it by https and check the node's name.
    tls: bool = False
    # Rank 0 of a replica of several shards: the port its engine's peers rendezvous at.
    dist_port: int | None = None
    pid: int | None = None
    restarts: int = 0
    failures: int = 0  # in a row, since the engine was last healthy for long enough
    backoff_s: float | None = None  # while failed: the wait before the next start
    startup_s: float | None = None  # seconds from the engine's start to its first ready probe
    error: str = ""
    # Why its engine last failed (its kind and error), kept after the agent restarted it:
    # a restart the control plane did not see as a failed state is still told why.
    last_failure: str = Field(default="", max_length=1000)
    log_tail: list[str] = Field(default_factory=list, max_length=MAX_LOG_TAIL_LINES)
    # The key its engine was started with: it answers (health checks aside) only requests
    # that carry it. Goes to the control plane and the routers, never to operators or logs.
    engine_key: str | None = Field(default=None, repr=False)
    generation: int = Field(default=0, ge=0)  # of the assignment it runs (ShardAssignment's)
    adapters: list[AdapterReport] = Field(default_factory=list)  # those it was told to hold

    @classmethod
    def of(cls, assignment: ShardAssignment, state: ShardState, **seen: Any) -> ShardReport:
        """The report of a shard running `assignment`, in `state`, with what else was seen
        of it (port, pid, restarts, error, ...)."""
        a = assignment
        return cls(
            replica_id=a.replica_id,
            model=a.model,
            rank=a.rank,
            num_shards=a.num_shards,
            gpus=a.gpus,
            engine_digest=a.engine_digest,
            state=state,
            generation=a.generation,
            **seen,
        )


def engine_endpoint(address: str, port: int, tls: bool) -> str:
    """The base URL routers reach an engine at: https for one behind its node's gate."""
    host = f"[{address}]" if ":" in address else address
    return f"{'https' if tls else 'http'}://{host}:{port}"


class AgentReport(_Message):
    node: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=64)  # new each agent start; seq counts within it
    seq: int = Field(ge=0)
    address: str  # host at which this node's engines are reachable
    labels: dict[str, str] = Field(default_factory=dict)
    gpus: list[GpuReport]
    shards: list[ShardReport]


class ShardAssignment(_Message):
    replica_id: str
    model: str
    engine: str
    source: str
    args: list[str]
    env: dict[str, str]
    command: str | None = None
    program: str | None = None  # the words that run the engine (None: the node's, or the default)
    rank: int
    num_shards: int
    gpus: list[int]
    engine_digest: str
    startup_timeout: float
    # A replica of several shards: "host:port" where shard 0 expects its peers, once shard 0's
    # agent has reported it (None before; a shard of rank > 0 waits for it to start).
    leader: str | None = None
    # A replica of several shards is restarted as one: when any shard fails, every shard is
    # stopped and started again, rank 0 first, with one more generation. An agent restarts
    # a shard whose generation changed; it never restarts a shard of several on its own.
    generation: int = Field(default=0, ge=0)
    # A model whose idle replicas sleep (`idle_action: sleep`): its engine is started with
    # sleep mode; `asleep` says whether it should sleep now, and at which level.
    sleep_mode: bool = False
    asleep: bool = False
    sleep_level: int = Field(default=1, ge=1, le=2)
    # A model with LoRA adapters: its engine is started to hold at most `max_loras` of rank
    # up to `max_lora_rank`; `adapters` (name -> source) are those its engine should hold now
    # (on shard 0 of a replica, the one that serves HTTP), loaded and unloaded while it runs.
    max_loras: int | None = Field(default=None, ge=1)
    max_lora_rank: int = Field(default=16, ge=1)
    adapters: dict[str, str] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        """The shard's identity on its node: replica id and rank."""
        return shard_key(self.replica_id, self.rank)


def shard_key(replica_id: str, rank: int) -> str:
    return f"{replica_id}/{rank}"


class LogRequest(_Message):
    """The control plane asks an agent for part of an engine's log (`ctl logs`), with the
    answer to a heartbeat; the agent sends it back as a `LogAnswer`."""

    id: str = Field(max_length=64)
    replica_id: str
    rank: int = Field(ge=0)
    previous: int = Field(default=0, ge=0)  # 0: the engine's current run; K: K runs back
    tail: int = Field(default=200, ge=1, le=100_000)  # lines, when no offset is given
    offset: int | None = Field(default=None, ge=0)  # bytes: what was written from there on
    # With an offset: the run that offset is in (`LogAnswer.run`). When the engine has started
    # again since, the rest of that run comes first, then the new run from its start.
    run: str | None = Field(default=None, max_length=64)
    # Without an offset: only what was written in the last `since_s` seconds, by the node's
    # own clock (the tail still applies).
    since_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class LogAnswer(_Message):
    id: str = Field(max_length=64)
    lines: list[str] = Field(default_factory=list)
    offset: int = 0  # where the log ends now: the next `offset` of a follow
    run: str = ""  # which run's log that offset is in: the next `run` of a follow
    error: str = ""  # no such log, or it could not be read


class NodeAssignment(_Message):
    """A node's whole desired shard set, as the answer to its agent's report or heartbeat."""

    node: str
    shards: list[ShardAssignment]
    # Names this shard set (the same shards, the same version): a heartbeat carries the version
    # its agent holds, and is answered with the assignment only when it is another.
    version: str = ""
    # Seconds between the agent's heartbeats while nothing changes; the control plane sets it
    # from the fleet's size (`ControlPlaneConfig.heartbeat_interval`).
    heartbeat_interval: float = Field(default=2.0, gt=0)
    # Engines' logs the control plane asks for (`ctl logs`); not part of the version.
    log_requests: list[LogRequest] = Field(default_factory=list)
    # The lease epoch of the leader that made it (0: a control plane alone on its store before
    # epochs were sent); an agent refuses one lower than it has seen. Not part of the version.
    epoch: int = Field(default=0, ge=0)


def assignment_version(shards: list[ShardAssignment]) -> str:
    """The version of a node's shard set: a digest of its wire form."""
    wire = b"[" + b",".join(s.model_dump_json().encode() for s in shards) + b"]"
    return hashlib.blake2b(wire, digest_size=8).hexdigest()


class Heartbeat(_Message):
    """What an agent sends instead of a report while its report is the one last taken: it is
    alive, and holds assignment `assignment`.

    The control plane answers at once when the node's assignment is another, or else holds the
    answer until it changes or `heartbeat_interval` has passed (a long poll), so an assignment
    reaches its agent as soon as it is made, with one request per node per interval.
    """

    node: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)  # counted with the reports: one more than the last report or beat
    assignment: str  # the version of the assignment the agent holds
    use: NodeUse | None = None


class HeartbeatAnswer(_Message):
    heartbeat_interval: float = Field(gt=0)
    assignment: NodeAssignment | None = None  # None: the one the agent holds is current
    log_requests: list[LogRequest] = Field(default_factory=list)
    epoch: int = Field(default=0, ge=0)  # as `NodeAssignment.epoch`


class LeaderAnswer(_Message):
    """A control plane's answer to an agent asking who leads (`GET /v1/leader`): whether it
    leads and acts now, the lease as it last saw it, and where its leader's agent API is."""

    leading: bool
    epoch: int = Field(ge=0)
    leader: str = ""  # who holds the lease, as last seen ("" when none yet)
    leader_url: str | None = None  # the leader's agent API (this one's own when leading)


class JoinRequest(_Message):
    """An agent's join: the node it will be, and a certificate request (PEM) for its admin
    listener, naming the hosts it is reached by. Sent with the join token as its bearer."""

    node: str = Field(pattern=NODE_NAME)
    csr: str = Field(max_length=8192)


class JoinAnswer(_Message):
    """The node's own credential (every report and heartbeat after carries it), the fleet's
    CA, and the admin listener's certificate signed by it (all PEM)."""

    node: str
    credential: str = Field(repr=False)
    ca: str
    cert: str


Routing = Literal["least_load", "prefix"]
OverCap = Literal["reject", "clamp"]


class RoutedModel(_Message):
    """One model as a router serves it: where its ready replicas are, and how to route to
    them (the catalog's routing fields)."""

    name: str
    endpoints: list[str]  # base URLs of serving replicas, e.g. http://127.0.0.1:8001
    # endpoint -> the key its engine wants (`Authorization: Bearer KEY`); none for an engine
    # of a static router config that has no key
    keys: dict[str, str] = Field(default_factory=dict, repr=False)
    replicas: dict[str, str] = Field(default_factory=dict)  # endpoint -> replica id
    # https endpoint -> the node whose gate serves it: its certificate must name that node
    # (`pki.node_host`), whatever address it is reached at.
    nodes: dict[str, str] = Field(default_factory=dict)
    routing: Routing = "least_load"
    # Seconds to the first byte of an answer before another replica is tried; None: the
    # router's own default.
    first_byte_timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_tokens_cap: int | None = Field(default=None, ge=1)
    max_tokens_over_cap: OverCap = "reject"
    # A model that follows its load (`autoscale`): the requests in flight each replica is
    # meant to carry. With no serving replica, a router holds up to `cold_queue` of its
    # requests for up to `cold_timeout` seconds while the control plane starts one, and
    # releases them at most `target_in_flight` to a replica. None: a fixed count.
    target_in_flight: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # The replicas the control plane keeps for it now: while fewer serve, requests held
    # since it had none are shared out as if they all did (`router/cold.py`).
    replicas_wanted: int | None = Field(default=None, ge=0)
    cold_queue: int = Field(default=256, ge=1)
    cold_timeout: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    # Its LoRA adapters: each adapter's name -> the endpoints whose engines hold it loaded
    # (none yet: a request for it waits, as for a cold model, until one does).
    adapters: dict[str, list[str]] = Field(default_factory=dict)
    # An adapter no engine holds and one failed to load: the engine's words for it.
    adapter_errors: dict[str, str] = Field(default_factory=dict)
    # While none of its replicas serves and none is coming: why, as the control plane sees it
    # (those wanted cannot be placed, and why; its engine keeps failing, and the last error).
    # A router answers its requests 503 with this, without a Retry-After. "": one serves, or
    # one is on its way (a request gets a Retry-After, or is held for it).
    cannot_serve: str = Field(default="", max_length=4000)


class RoutedKey(_Message):
    """A client API key as routers take it: its hash, what it may use, its limits."""

    name: str
    sha256: str
    models: list[str] | None = None  # None: every model
    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    max_concurrent: int | None = Field(default=None, gt=0)
    expires_at: float | None = None  # wall-clock seconds


class EngineClient(_Message):
    """What a router needs to reach engines behind their gates: the fleet's CA (PEM), which
    their certificates are checked against, and a router's client certificate and its key
    (`pki.CertificateAuthority.issue_router_client`), which the gates let in."""

    ca: str
    cert: str
    key: str = Field(repr=False)


class RoutingSnapshot(_Message):
    """A whole routing table. (epoch, version) orders tables: the epoch grows at every start
    of the control plane, the version at every change within one."""

    epoch: int = Field(default=0, ge=0)
    version: int = Field(ge=0)
    catalog_version: int = 0
    models: list[RoutedModel]
    # From a control plane with a CA: how to reach engines behind gates (https endpoints).
    engine_client: EngineClient | None = None
    # The keys the control plane manages, besides those of the router's own config.
    keys: list[RoutedKey] = Field(default_factory=list)


# The header of a router's answers about its table (a push's, "which table is held"): one
# value per run of its process, so that the control plane tells a restart it never saw down
# (a router that restores its table from its table file is back between two checks).
ROUTER_RUN_HEADER = "x-modelfleet-router-run"


class RoutingAck(_Message):
    """A router's answer to a push (whether it took the table) or to the question which table
    it holds (whether it holds a pushed one at all), with that table's epoch and version."""

    applied: bool
    epoch: int = 0
    version: int


class ModelLoad(_Message):
    """What one router sees of one model's load (`GET /v1/load`)."""

    in_flight: int = Field(default=0, ge=0)  # its requests at the model's replicas now
    held: int = Field(default=0, ge=0)  # its requests held while no replica serves
    # Requests running and waiting at the model's engines, from every router and client, as
    # this router last read the engines' metrics.
    engines: int = Field(default=0, ge=0)
    # replica id -> [this router's requests at it, its engine's own count as last read]
    replicas: dict[str, tuple[int, int]] = Field(default_factory=dict)
    # replica id -> the share of its engine's KV cache in use, as this router last read it
    cache: dict[str, Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    # A LoRA adapter: requests per second asked of this router lately (fading over ~30 s).
    rate: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # A LoRA adapter: seconds the oldest request this router holds for it has waited.
    waited: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class Ejection(_Message):
    """A replica a router has taken out of rotation: why, for how many seconds more (then
    a health probe decides), and how many times in a row."""

    why: str
    left_s: float = Field(ge=0, allow_inf_nan=False)
    times: int = Field(ge=1)


class LoadReport(_Message):
    """A router's load per model, read by the leading control plane every second, and the
    replicas it has taken out of rotation (replica id -> why), so that `ctl events` shows it."""

    models: dict[str, ModelLoad] = Field(default_factory=dict)
    ejected: dict[str, Ejection] = Field(default_factory=dict)
    # In how many counts each key's limits are kept at this router: one per worker of a
    # router of `workers: N` without a `limits_store` (each its own memory: a key gets up
    # to N times its limits there); 1 where one count holds (one process, or Redis).
    limit_counts: int = Field(default=1, ge=1)


class UsageRow(_Message):
    """What one key did with one model in one hour, as counted by a router."""

    key: str
    model: str
    hour: int  # wall-clock seconds at the start of the hour
    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    errors: int = Field(ge=0)  # answers of status 400 and over
    last_at: float  # wall-clock seconds of the last of them
    limited: int = Field(default=0, ge=0)  # refused for the key's own limits (429)


class UsageBatch(_Message):
    """A router's counts since its last batch was collected. `run` names one run of one
    router process; (run, batch) is counted once, however often it is sent."""

    run: str
    batch: int
    rows: list[UsageRow]


class UsageReport(_Message):
    """A router's answer to the control plane's collection: one batch per router process
    (several with `workers`), or none when nothing was counted."""

    batches: list[UsageBatch] = Field(default_factory=list)


class UsageAck(_Message):
    """The batches the control plane has stored; the router forgets them."""

    batches: list[tuple[str, int]]  # (run, batch)
