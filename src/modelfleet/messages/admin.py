"""The admin API's messages: what the control plane answers and what `ctl` reads.

One schema, imported by both ends. The control plane serves it as an OpenAPI document at
`/openapi.json` on its admin listener, so operators can drive the fleet from their own tools.
Every error of the admin API is an `ErrorAnswer`.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from modelfleet.core.units import POSITIVE_DURATION_PATTERN

MarkName = Literal["none", "cordoned", "draining"]  # what an operator may set
NodeMarkName = Literal["none", "cordoned", "draining", "revoked"]  # what a node may have
MAX_HISTORY = 1000  # catalog versions one history answer lists at most


class _Answer(BaseModel):
    model_config = ConfigDict(frozen=True)


class CatalogProblem(_Answer):
    """One problem of a refused catalog: which model, which field, and what is wrong."""

    model: str
    field: str
    message: str


# A change's request id: ctl sends one with every change it may send again, and the control
# plane records it with the change, so the change is made at most once whatever is retried.
IDEMPOTENCY_KEY = "Idempotency-Key"
# Set (to "true") on the answer to a request id made before: what the earlier attempt did.
REPLAYED = "Idempotent-Replayed"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class ErrorAnswer(_Answer):
    """Every error of the admin API. `problems` lists what is wrong with a refused catalog.
    A change whose store call did not answer in time is `may_have_been_made` (503): sent again
    with the same `Idempotency-Key` (its `request_id`), it is made at most once, and the answer
    says whether the earlier attempt made it (`Idempotent-Replayed: true`)."""

    error: str
    problems: list[CatalogProblem] | None = None
    may_have_been_made: bool | None = None
    request_id: str | None = None


# -- nodes ---------------------------------------------------------------------------------


class GpuInfo(_Answer):
    index: int
    model: str
    memory_total: int
    memory_free: int
    healthy: bool
    reason: str  # why it is unhealthy
    in_use: bool


class NodeInfo(_Answer):
    name: str
    ready: bool  # reported within node_stale_after
    mark: NodeMarkName
    drain_grace_left_s: float | None  # while draining with a bound
    address: str
    labels: dict[str, str]
    last_heard_s: float  # seconds since its last report or heartbeat
    reports: int  # whole reports taken from it since the control plane started
    heartbeats: int  # heartbeats taken from it since the control plane started
    gpus: list[GpuInfo]
    shards: int  # shards its agent reports
    replicas: int  # replicas with a shard on it


class NodesAnswer(_Answer):
    nodes: list[NodeInfo]
    # Set when every node is silent: the control plane or its network is at fault, and no
    # replica is moved off a lost node until one reports again.
    warning: str = ""


class NodeDeleted(_Answer):
    """A node forgotten by the control plane, and the replicas that had to leave with it."""

    node: str
    retired: list[str]  # replicas taken out of service (with force), placed anew elsewhere


class MarkRequest(BaseModel):
    """Cordon (`cordoned`), drain (`draining`) or uncordon (`none`) a node."""

    model_config = ConfigDict(extra="forbid")
    mark: MarkName
    # A drain's bound in seconds: what has not moved by then is stopped anyway. None: the
    # control plane's drain_grace; 0: no bound.
    grace_s: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)
    # Only say what the mark would move, and what could not be replaced: nothing is marked.
    dry_run: bool = Field(default=False, strict=True)


# -- placement -----------------------------------------------------------------------------


class NodeVerdict(_Answer):
    """What placement made of one node: the GPUs a shard could use there, or why none."""

    node: str
    usable_gpus: list[int]
    reasons: list[str]  # empty when the node can host a shard


class ShardSpot(_Answer):
    """Where one shard of a replica goes: a node and its GPUs."""

    node: str
    gpus: list[int]


class Explanation(_Answer):
    """Where a model's next replica would go, or every node considered and why not."""

    model: str
    needs: str  # what each shard needs, in words
    pending: int  # replicas of the model that cannot be placed now
    pending_reason: str
    placeable: bool
    summary: str
    placement: list[ShardSpot]  # the next replica's shards, when placeable
    nodes: list[NodeVerdict]


class MoveInfo(_Answer):
    """A replica moved to even out its model: replaced on `to_node`, make-before-break."""

    replica: str
    model: str
    from_node: str
    to_node: str  # where its replacement is expected to go
    reason: str


class RebalanceAnswer(_Answer):
    """What a rebalance moves (or would move, with `dry_run`)."""

    dry_run: bool
    moves: list[MoveInfo]


# -- replicas ------------------------------------------------------------------------------

# "out-of-rotation": every shard ready, but a router sends it no requests (`ejected` says
# which and why): what its clients get, not what its engine says. "failed": a shard failed,
# or was started again after failing and is not ready since (a crash loop): `error` says why.
ReplicaState = Literal[
    "ready", "out-of-rotation", "starting", "failed", "assigned", "retiring", "sleeping"
]


class AdapterInfo(_Answer):
    """A LoRA adapter a replica should hold, as its agent last reported it."""

    name: str
    state: str  # loading, loaded, failed; or "wanted" before its agent has reported it
    tries: int = 0  # loads its engine refused (in this engine process)
    error: str = ""  # the engine's words for the last


class AdapterChange(_Answer):
    """What a catalog change makes one replica's engine load and unload (no restart)."""

    replica: str
    load: list[str]
    unload: list[str]


class ShardInfo(_Answer):
    rank: int
    node: str
    gpus: list[int]
    state: str  # a shard state (starting, ready, failed, stopping), or "assigned" before its
    # agent has reported it
    port: int | None
    pid: int | None
    restarts: int
    failures: int  # in a row
    backoff_s: float | None  # while failed: the wait before its agent starts it again
    startup_s: float | None  # seconds from the engine's start to ready
    error: str
    log_tail: list[str]  # the engine's last log lines; only in a single replica's answer
    engine_key_set: bool = False  # whether its engine wants a key (which is never shown)
    adapters: list[AdapterInfo] = []  # shard 0 of a replica of a model with LoRA adapters


class ReplicaInfo(_Answer):
    id: str
    model: str
    state: ReplicaState
    endpoint: str | None  # where routers send its requests, once ready
    shards: list[ShardInfo]
    reason: str = ""  # why it is retiring
    # A replica of several shards: how many times all its shards were restarted together,
    # those since it last served, and why the last restart was made (which shard failed).
    generation: int = 0
    group_restarts: int = 0
    last_failure: str = ""
    # The routers that send it no requests now (they took it out of rotation), and why.
    ejected: list[str] = Field(default_factory=list)
    # While failed: why, with its engine's last error (also while the next start of a crash
    # loop is under way, when the shard's own `error` is empty).
    error: str = ""


class PendingInfo(_Answer):
    """Replicas of a model that cannot be placed now, and every node's verdict."""

    model: str
    count: int
    reason: str
    needs: str
    nodes: list[NodeVerdict]


class ScaleInfo(_Answer):
    """A model that follows its load: its count now, its bounds, and why."""

    model: str
    replicas: int  # the count the control plane keeps now
    min: int
    max: int
    target_in_flight: float  # requests per replica it scales to
    reason: str  # why the count was last set, with the numbers that set it
    since: float | None = None  # wall-clock seconds it was set at; None: never decided yet
    load: float | None = None  # requests it carries, as last read (the leader's only)
    now: str = ""  # what the last decision said (the leader's only)


class ReplicasAnswer(_Answer):
    replicas: list[ReplicaInfo]
    pending: list[PendingInfo]
    scaling: list[ScaleInfo] = Field(default_factory=list)


# -- catalog -------------------------------------------------------------------------------


class AutoscaleInfo(_Answer):
    """A model's `autoscale` bounds and timers (seconds)."""

    min: int
    max: int
    target_in_flight: float
    scale_up_after: float
    scale_down_after: float
    scale_to_zero_after: float


class AdapterSpec(_Answer):
    """One LoRA adapter of a model, as the catalog declares it."""

    name: str
    source: str
    max_rank: int | None = None


class ModelInfo(_Answer):
    """One model of the catalog, as validated, in the catalog file's own keys (sizes in bytes,
    durations in seconds, every default filled in): the models of a `CatalogAnswer`, with
    their None fields left out, are a catalog that applies as the same one."""

    name: str
    engine: str
    source: str
    args: list[str]
    env: dict[str, str]
    command: str | None
    replicas: int | None = None  # None: it follows its load (`autoscale`)
    shards: int
    gpus_per_shard: int
    gpu_memory: int
    gpu_model: str | None
    node_labels: dict[str, str]
    placement: str
    startup_timeout: float
    max_parallel: int
    routing: str = "least_load"
    first_byte_timeout: float | None = None
    max_tokens_cap: int | None = None
    max_tokens_over_cap: str = "reject"
    autoscale: AutoscaleInfo | None = None
    cold_queue: int | None = None  # these four only with autoscale
    cold_timeout: float | None = None
    idle_action: str | None = None
    sleep_level: int | None = None  # only with idle_action: sleep
    adapters: list[AdapterSpec] | None = None  # these three only with adapters or max_loras
    max_loras: int | None = None
    max_lora_rank: int | None = None


class Rejection(_Answer):
    """The last catalog that was refused: when, from where, and every problem."""

    at: float
    source: str
    problems: list[str]


class CatalogAnswer(_Answer):
    version: int
    digest: str
    applied_at: float  # wall-clock seconds
    source: str  # "api" or the path of the catalog file
    models: list[ModelInfo]
    last_rejection: Rejection | None


class CatalogVersion(_Answer):
    version: int
    digest: str
    applied_at: float
    source: str
    models: list[str]


class CatalogHistory(_Answer):
    versions: list[CatalogVersion]  # newest first


class Step(_Answer):
    """One replica a change starts or stops, at the pass (`step`, from 1) it happens."""

    step: int
    action: Literal["start", "stop"]
    id: str  # "new-1", "new-2", ... for a replica yet to start
    model: str
    shards: list[ShardSpot]
    reason: str


class PendingStep(_Answer):
    model: str
    count: int
    reason: str


class CatalogChange(_Answer):
    """What applying a catalog did (or, for a dry run, would do), step by step."""

    dry_run: bool
    changed: bool  # the catalog differs from the one that was current
    version: int  # the current version, after the apply
    previous_version: int | None = None
    digest: str | None = None
    steps: list[Step]
    pending: list[PendingStep]
    # Replicas kept whose engines load or unload LoRA adapters (no restart).
    adapters: list[AdapterChange] = []


class MarkAnswer(_Answer):
    """A node's new mark (or, in a dry run, the mark it would get), and what moves because of
    it: `pending` are replacements that cannot be placed."""

    node: str
    mark: MarkName
    was: MarkName
    drain_grace_s: float | None
    steps: list[Step]
    pending: list[PendingStep]
    dry_run: bool = False
    # Replicas on a node being drained whose model has a replacement that cannot be placed
    # (`pending` says why): "id (model)".
    cannot_move: list[str] = Field(default_factory=list)


# -- the control plane itself -----------------------------------------------------------


class ControlPlaneInfo(_Answer):
    """A control plane on the store, as it last said it was alive."""

    name: str  # host:state-dir, its name in the lease
    agent_url: str
    admin_url: str
    seen_ago_s: float  # by the store's clock
    leads: bool  # holds the lease
    answering: bool  # the one that answered this status


class StatusAnswer(_Answer):
    """What the control plane is doing: settling after its start, or reconciling."""

    settling: bool  # still waiting for agents to report what runs; nothing placed or stopped
    reconcile_passes: int  # passes made (not settling) since the control plane started
    # Of those, the passes that planned: the others found nothing new to plan from.
    reconcile_plans: int = 0
    last_plan_ms: float | None = None  # how long the last pass that planned took
    last_idle_pass_ms: float | None = None  # how long the last pass that did not plan took
    heartbeat_interval: float = 0.0  # seconds, as told to agents now (it grows with the fleet)
    catalog_version: int
    routing_epoch: int  # one more at every start of the control plane
    routing_version: int  # of the routing table last published, within the epoch
    nodes: int  # nodes that have reported
    replicas: int  # in the table, retiring ones included
    pending: int  # replicas wanted that cannot be placed now
    # Of `replicas`, those failed: a shard failed, or crash-looping (`ctl replicas` says why).
    failed: int = 0
    frozen: str = ""  # why nothing is moved off lost nodes (every node is silent), or ""
    # Why the store cannot write (a full disk, a read-only file), or "": changes are refused
    # with 503 and collected usage waits at the routers until it can again.
    store_problem: str = ""
    # The store (its place, never its password), and the lease of the control planes on it.
    store: str = ""
    leading: bool = True  # this control plane leads (a follower plans nothing)
    leader: str = ""  # who holds the lease, as last seen
    lease_epoch: int = 0
    # Why this control plane refuses to lead, or "": another live process holds the lease
    # under its name (a copied state dir, a cloned machine).
    lease_refused: str = ""
    control_planes: list[ControlPlaneInfo] = Field(default_factory=list)
    scaling: list[ScaleInfo] = Field(default_factory=list)  # the models that follow their load


# -- routing -------------------------------------------------------------------------------


class RoutedInfo(_Answer):
    """A model as the routers are told it, without its engines' keys."""

    name: str
    endpoints: list[str]
    keyed: list[str]  # the endpoints whose engine wants a key (which is never shown)


class RoutingAnswer(_Answer):
    """The routing table last published, and the version of it each router confirmed."""

    epoch: int  # one more at every start of the control plane
    version: int
    catalog_version: int
    models: list[RoutedInfo]
    routers: dict[str, int]


# -- API keys ------------------------------------------------------------------------------

KeyName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
MAX_LIMIT = 10**12  # past any real limit; larger numbers do not fit the store's integers
# An IPv4 address other than loopback (127/8) and 0/8, written plainly: what a join token may
# allow a node to advertise, stated here so the API document says exactly what is taken.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
TOKEN_ADDRESS_PATTERN = (
    r"^(25[0-5]|2[0-4][0-9]|1[3-9][0-9]|12[0-689]|1[01][0-9]|[1-9][0-9]?)"
    rf"(\.{_OCTET}){{3}}$"
)
MAX_TOKEN_ADDRESSES = 15  # with the node's own, what one certificate names at most (pki.MAX_NAMES)


def _whole(value: object) -> object:
    """60.0 as the whole number 60: the document's `integer` (JSON Schema's) counts it one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Strict: a JSON `true` is no limit of 1, nor 60.5 a count (pydantic would take both); 60.0
# is 60, as the document says.
Limit = Annotated[int, Field(gt=0, le=MAX_LIMIT, strict=True), BeforeValidator(_whole)]
Clearable = Literal["models", "rpm", "tpm", "max_concurrent", "expires"]


# A key's `expires` as the document states it and `keys.parse_expiry` reads it: a duration
# from now, or an ISO 8601 date that exists (a time and a zone may follow). Written out here
# rather than left to `datetime.fromisoformat`, which takes more forms than a pattern of the
# document could say and refuses dates a pattern could not tell from real ones.
_YEAR = r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
    rf"|(?:0[13578]|1[02])-31)|{_LEAP_YEAR}-02-29)"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:\.[0-9]{1,6})?)?"
_ZONE = r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
EXPIRY_DATE_PATTERN = rf"^\s*{_DATE}(?:T{_TIME}{_ZONE}?)?\s*$"
Expires = Annotated[
    str, Field(json_schema_extra={"pattern": f"{POSITIVE_DURATION_PATTERN}|{EXPIRY_DATE_PATTERN}"})
]


class KeyCreate(BaseModel):
    """Make a client API key. Limits left out are no limits; `models` left out is every
    model. `expires`: a duration (`30d`, `12h`) or an ISO 8601 date or time."""

    model_config = ConfigDict(extra="forbid")
    name: KeyName
    models: list[str] | None = Field(default=None, min_length=1)
    rpm: Limit | None = None
    tpm: Limit | None = None
    max_concurrent: Limit | None = None
    expires: Expires | None = None


class KeyUpdate(BaseModel):
    """Change a key: what is given is set, what `clear` names is removed (no limit, every
    model, never expires), the rest stays."""

    # A field may be given or cleared, not both (`keys.py`): stated for the document.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "allOf": [
                {
                    "not": {
                        "required": [field, "clear"],
                        "properties": {"clear": {"contains": {"const": field}}},
                    }
                }
                for field in get_args(Clearable)
            ]
        },
    )
    models: list[str] | None = Field(default=None, min_length=1)
    rpm: Limit | None = None
    tpm: Limit | None = None
    max_concurrent: Limit | None = None
    expires: Expires | None = None
    clear: list[Clearable] = Field(default_factory=list)


class KeyInfo(_Answer):
    """A key as the control plane keeps it: never the key itself, only its first characters."""

    name: str
    prefix: str
    models: list[str] | None  # None: every model
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    created_at: float  # wall-clock seconds
    expires_at: float | None
    # Usage so far, as the control plane has collected it from the routers.
    requests: int = 0
    tokens: int = 0  # prompt + completion
    last_used_at: float | None = None


class KeyCreated(KeyInfo):
    key: str  # shown this once; the control plane keeps only its hash


class KeysAnswer(_Answer):
    keys: list[KeyInfo]


# -- joining -------------------------------------------------------------------------------


class JoinTokenCreate(BaseModel):
    """Make a join token. `ttl`: how long it can be used (`90m`, `1h`, `7d`; `never`);
    `uses`: how many nodes may join with it (one unless told); `addresses`: IP addresses a
    node joining with it may advertise (and have its certificate name) besides the one it
    joins from (never loopback: that only a loopback join gets)."""

    model_config = ConfigDict(extra="forbid")
    # Stated in the document, judged by the handler (which says what a duration is).
    ttl: str = Field(
        "1h", json_schema_extra={"pattern": rf"^\s*never\s*$|{POSITIVE_DURATION_PATTERN}"}
    )
    uses: Limit = 1
    # Stated in the document, judged by the handler (which says what is wrong in words).
    addresses: list[Annotated[str, Field(json_schema_extra={"pattern": TOKEN_ADDRESS_PATTERN})]] = (
        Field(default_factory=list, max_length=MAX_TOKEN_ADDRESSES)
    )


class JoinTokenInfo(_Answer):
    """A join token as the control plane keeps it: never its secret."""

    id: str
    created_at: float  # wall-clock seconds
    expires_at: float | None  # None: never
    uses_left: int | None  # None: any number
    used: int  # nodes that joined with it
    state: Literal["usable", "expired", "used up"]
    addresses: list[str] = []  # those a node joining with it may advertise besides its own


class JoinTokenCreated(JoinTokenInfo):
    token: str  # shown this once; the control plane keeps only a hash of its secret
    ca_fingerprint: str  # the CA the token pins, "sha256:<hex>"


class JoinTokensAnswer(_Answer):
    tokens: list[JoinTokenInfo]


class CredentialInfo(_Answer):
    """A node credential the control plane gave (never the credential itself)."""

    node: str
    issued_at: float  # wall-clock seconds
    token_id: str  # the join token it was given for
    # The addresses it may advertise: the one it joined from, then those its token allowed
    # (None: not kept, a credential given before they were).
    addresses: list[str] | None
    reported: bool  # whether its node has reported to this control plane's term


class CredentialsAnswer(_Answer):
    """Every node credential given and not revoked, whether its node reported or not."""

    credentials: list[CredentialInfo]


class NodeRevoked(_Answer):
    """A node cut off: its credential deleted, its replicas replaced elsewhere."""

    node: str
    replacing: list[str]  # its replicas, replaced elsewhere as a lost node's are


# -- logs ----------------------------------------------------------------------------------


class LogsAnswer(_Answer):
    """Part of an engine's output, as its agent read it."""

    replica: str
    shard: int
    node: str
    previous: int  # 0: the current run; K: K runs back
    lines: list[str]
    offset: int  # where the log ends now: the `offset` to follow from
    run: str = ""  # the run that offset is in: the `run` to follow with (across restarts)


# -- events --------------------------------------------------------------------------------


class EventInfo(_Answer):
    """Something that happened (`controlplane/events.py`); a repeat counts up."""

    id: int
    type: Literal["normal", "warning"]
    reason: str
    regarding: str  # KIND/NAME: node/gpu-1, replica/chat-1a2b3c, model/chat, key/alice
    message: str
    count: int
    first_at: float  # wall-clock seconds
    last_at: float
    source: str


class EventsAnswer(_Answer):
    events: list[EventInfo]


# -- usage ---------------------------------------------------------------------------------


class UsageInfo(_Answer):
    """What one key did with one model in one hour, summed over every router."""

    key: str
    model: str
    hour: float  # wall-clock seconds at the start of the hour
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int  # answers of status 400 and over


class UsageAnswer(_Answer):
    since: float  # wall-clock seconds: the start of the first hour asked for
    usage: list[UsageInfo]
