"""What the agent is told at its start (`agent` command line options): how it reaches the
control plane (`AgentSettings`), and how it supervises its engines (`SupervisorSettings`):
where they listen (and behind which TLS gate), how often they are probed, how long they get
to stop, how restarts back off, and what each one gets of the agent's environment and of
the node."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from modelfleet.agent.credential import HeldToken
from modelfleet.core.backoff import Backoff
from modelfleet.security.pki import TlsFiles


@dataclass(frozen=True)
class EngineTls:
    """The node's certificate and key, and the fleet's CA: an agent that has them starts
    every engine that serves HTTP on loopback behind a gate on `engine_host` (`gate.py`)."""

    files: TlsFiles
    ca: Path


@dataclass(frozen=True)
class SupervisorSettings:
    engine_host: str = "127.0.0.1"
    engine_tls: EngineTls | None = None  # None: engines listen on engine_host themselves
    probe_interval: float = 0.25  # while starting
    watch_interval: float = 0.5  # once ready: how often its exit is looked for
    # Once ready, its health is probed this often; this many failed probes in a row (each
    # bounded by liveness_timeout) make it unready, and it is restarted.
    liveness_interval: float = 5.0
    liveness_timeout: float = 2.0
    liveness_failures: int = 3
    stop_grace: float = 30.0  # SIGTERM, then SIGKILL after this many seconds
    # An engine that crashes after it served is started again at once; one that keeps crashing
    # waits backoff_base, doubling up to backoff_max. This long ready starts the count over.
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    healthy_reset: float = 600.0
    pass_env: tuple[str, ...] = ()  # the agent's variables its engines get besides BASE_ENV
    # This node's command for an engine, by engine name (`agent --engine-program`); a model's
    # `program` in the catalog goes before it.
    programs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # A node that offers CPU slots (`agent --cpu-slots`): each slot's cores, by its index.
    cpu_slots: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_base, self.backoff_max, self.healthy_reset)


@dataclass(frozen=True)
class AgentSettings:
    control_plane: str
    node: str
    token: str | None
    state_dir: Path
    # Checks the control plane's certificate (`pki.client_context`); None: the system's CAs.
    verify: ssl.SSLContext | None = None
    admin_tls: TlsFiles | None = None  # the admin listener's certificate, once joined
    address: str = "127.0.0.1"
    labels: tuple[tuple[str, str], ...] = ()
    report_interval: float = 2.0
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    # Every control plane of the fleet, `control_plane` first, when several share a store:
    # the agent reports to one, follows a follower's redirect to the leader, and goes to the
    # next when it fails.
    control_planes: tuple[str, ...] = ()
    # How it reaches the control plane; None: the network (tests pass httpx.MockTransport).
    transport: httpx.AsyncBaseTransport | None = None
    # The join token the agent was given (`--join`) with a credential kept already: when the
    # control plane refuses that credential (the node revoked, and re-added with a new token),
    # the agent joins anew with it. Forgotten once the control plane takes a credential.
    join_token: HeldToken = field(default_factory=HeldToken, repr=False)
