"""The router's config file: where it listens (and its TLS), its keys, its static models,
its timeouts and bounds, its workers, where its limits and spans go."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modelfleet.messages.wire import RoutedModel
from modelfleet.router.table import ApiKey
from modelfleet.security.apikeys import hash_key
from modelfleet.security.pki import TlsFiles, is_loopback

# The folder in the system's temp dir of a router of several workers (their configs, with
# the push token): `host.files.owned_temp_dir`'s, swept by every router's start.
WORKERS_TEMP_PREFIX = "modelfleet-router-"


class KeyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    key: str | None = None  # plaintext, hashed at load; prefer sha256 in files
    models: list[str] | None = None
    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)
    max_concurrent: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_of_key(self) -> KeyConfig:
        if (self.sha256 is None) == (self.key is None):
            raise ValueError(f"key {self.name!r}: give exactly one of 'sha256' or 'key'")
        return self

    def to_key(self) -> ApiKey:
        digest = self.sha256 or hash_key(self.key or "")
        models = frozenset(self.models) if self.models else None
        return ApiKey(self.name, digest, models, self.rpm, self.tpm, self.max_concurrent)


class RouterConfig(BaseModel):
    """The router's config file."""

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    push_port: int = Field(default=8081, ge=0, le=65535)
    # TLS (`pki.py`). The client listener serves with `tls_cert`/`tls_key`: a certificate of
    # the fleet's CA (`modelfleet certificate`) or the operator's own; the push listener with
    # `push_tls_cert`/`push_tls_key`, by default the same, which the control plane checks
    # against its CA. Beyond loopback both listeners must have one: plain HTTP never leaves
    # the machine.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    push_tls_cert: Path | None = None
    push_tls_key: Path | None = None
    push_token: str | None = None  # shared admin token for routing pushes; None: pushes refused
    api_keys: list[KeyConfig] = Field(default_factory=list)
    models: list[RoutedModel] = Field(default_factory=list)  # the static seed
    # Where the router keeps the last table pushed to it, so that a restarted router serves
    # from it at once (until the control plane, which finds it restarted, pushes the current).
    table_file: Path | None = None
    max_body_bytes: int = Field(default=10 << 20, gt=0)  # a larger request gets 413, unread
    # Seconds. Connecting to an engine; its first byte (a whole answer, unless streamed: set
    # it per model in the catalog for long prefills); the gap between two chunks after it.
    connect_timeout: float = Field(default=5.0, gt=0)
    first_byte_timeout: float = Field(default=300.0, gt=0)
    chunk_timeout: float = Field(default=60.0, gt=0)
    retries: int = Field(default=1, ge=0)  # other replicas tried before the first byte
    # What one client may cost the client listener. Seconds: a request's headers must be in
    # within `client_head_timeout` of their first byte and its body within
    # `client_body_timeout` of them (408 and close otherwise); an answer the client reads
    # nothing of for `client_write_timeout` is cut off. Past `max_connections` open at once,
    # the longest idle connection is closed for each new one (a new one, when none is idle).
    client_head_timeout: float = Field(default=10.0, gt=0)
    client_body_timeout: float = Field(default=60.0, gt=0)
    client_write_timeout: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=10_000, ge=1)
    # Prefix routing hashes this many leading characters of the prompt.
    prefix_chars: int = Field(default=256, ge=1)
    # How often each engine's queue depth is read from its /metrics, and ejected engines
    # probed at /health; 0 turns it off (the router's own counts alone then).
    watch_interval: float = Field(default=0.5, ge=0)
    # Router processes on the client port (SO_REUSEPORT), for when one core is not enough;
    # the push API stays one, in the parent (router/workers.py).
    workers: int = Field(default=1, ge=1, le=64)
    reuse_port: bool = False  # set by the parent of several workers on each of them
    # Set too: a worker's push API is its parent's alone, plain HTTP on 127.0.0.1 (the parent
    # serves the push API to the control plane, with TLS where the router's host needs it).
    parent_push: bool = False
    # Set too: the parent's pid. A worker ends when its parent does (the kernel tells it, and
    # it checks every second): a worker left behind served the port with no new tables or
    # keys, beside the next router started on it.
    parent_pid: int | None = None
    # Set too: where this worker keeps the counts it showed (`metrics.WorkerCounts`), so that
    # the router's counters go on from them when it is restarted, or stalls.
    counts_file: Path | None = None
    # Where keys' rate counters live: None keeps them in this router's memory (right for one
    # router); a Redis URL (redis://host:port/db) shares them with every router naming it.
    limits_store: str | None = None
    # When the limits store cannot be reached or answers too slowly: refuse requests of keys
    # with limits with 503 naming why (closed), or let them through unlimited (open: their
    # limits do not hold meanwhile). Logged either way.
    limits_fail: Literal["open", "closed"] = "closed"
    # The output bound of a request of a key with a token limit that names no number in
    # max_tokens (nor max_completion_tokens): reserved against the limit, and sent to the
    # engine as its max_tokens, so that the engine is held to what was reserved.
    default_max_tokens: int = Field(default=1024, gt=0)
    # Where the spans of requests are sent, by OTLP over HTTP: the full traces URL of a
    # collector (http://collector:4318/v1/traces). None: none are built (the trace context
    # still goes to each engine, in `traceparent`).
    otlp_endpoint: str | None = None

    @property
    def client_tls(self) -> TlsFiles | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key)

    @property
    def push_host(self) -> str:
        return "127.0.0.1" if self.parent_push else self.host

    @property
    def push_tls(self) -> TlsFiles | None:
        if self.parent_push:
            return None
        if self.push_tls_cert is None or self.push_tls_key is None:
            return self.client_tls
        return TlsFiles(self.push_tls_cert, self.push_tls_key)

    @model_validator(mode="after")
    def _tls(self) -> RouterConfig:
        for cert, key in (("tls_cert", "tls_key"), ("push_tls_cert", "push_tls_key")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"give both {cert} and {key}, or neither")
        push_open = self.push_tls is None and not is_loopback(self.push_host)
        if not is_loopback(self.host) and (self.client_tls is None or push_open):
            raise ValueError(
                f"host is {self.host!r}: beyond loopback the router serves TLS only (API keys "
                "and the push token would cross the network in clear); give tls_cert and "
                "tls_key (`modelfleet certificate` issues them from the control plane's CA)"
            )
        return self
