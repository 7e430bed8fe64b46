"""A shard's first stage: its engine started, in a session and process group of its own with
its output in its log, so that it outlives the agent.

`launch` works out what to run (the driver's command for the assignment, pinned to CPU
slots, behind a TLS gate when the node has a certificate) without starting anything;
`spawn` starts it."""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from modelfleet.agent.pin import pinned
from modelfleet.engines import EngineDriver, Launch, NoDriver
from modelfleet.engines.base import Start, engine_environment
from modelfleet.host.files import open_private_log
from modelfleet.host.network import interface_of
from modelfleet.host.processes import free_port

if TYPE_CHECKING:
    from modelfleet.agent.settings import EngineTls, SupervisorSettings
    from modelfleet.messages.wire import ShardAssignment

ENGINE_KEY_PREFIX = "mfe-"  # an engine's key, recognisable to secret scanners
LOOPBACK = "127.0.0.1"


class CannotStart(Exception):
    """The engine cannot be started here: why, in the operator's words."""


@dataclass(frozen=True)
class Launched:
    """What to run for a shard, and where it is reached."""

    launch: Launch
    port: int  # where routers reach it
    local_port: int | None  # behind a gate: the engine's own, on loopback
    key: str  # the engine's key, which routers and the agent send


def gated(launch: Launch, tls: EngineTls, listen: str, engine_port: int) -> Launch:
    """`launch` wrapped in a gate (`gate.py`) that serves `listen` ("host:port") with TLS to
    the fleet's routers and relays to the engine on loopback `engine_port`."""
    argv = [sys.executable, "-m", "modelfleet", "engine-gate", "--listen", listen]
    argv += ["--engine-port", str(engine_port), "--ca", str(tls.ca)]
    argv += ["--cert", str(tls.files.cert), "--key", str(tls.files.key), "--", *launch.argv]
    return dataclasses.replace(launch, argv=argv)


def launch(
    assignment: ShardAssignment,
    driver: EngineDriver | NoDriver,
    settings: SupervisorSettings,
    leader: str | None,
) -> Launched:
    """What starts `assignment`'s engine, on ports free now. Raises CannotStart."""
    if isinstance(driver, NoDriver):
        raise CannotStart(str(driver))
    host, tls = settings.engine_host, settings.engine_tls
    port = free_port(host, "engines")
    local_port = free_port(LOOPBACK, "engines") if tls is not None else None
    key = ENGINE_KEY_PREFIX + secrets.token_urlsafe(24)
    slots = settings.cpu_slots
    cores = tuple(slots.get(g, ()) for g in assignment.gpus) if slots else ()
    if slots and not (cores and all(cores)):
        raise CannotStart(f"no CPU slot {assignment.gpus} on this node")
    try:
        got = driver.launch(
            Start(
                assignment,
                host if tls is None else LOOPBACK,
                port if local_port is None else local_port,
                key,
                leader=leader,
                address=host,
                stop_grace=settings.stop_grace,
                programs=settings.programs,
                cores=cores,
            )
        )
    except NoDriver as exc:
        raise CannotStart(str(exc)) from None
    if cores:
        got = dataclasses.replace(got, argv=pinned(got.argv, sum(cores, ())))
    if tls is not None and got.health_path is not None:
        got = gated(got, tls, f"{host}:{port}", local_port or 0)
    elif tls is not None:  # it serves no HTTP (a worker rank): nothing to gate
        port, local_port = local_port or 0, None
    return Launched(got, port, local_port, key)


def spawn(
    launched: Launched, log_path: Path, extra_env: Mapping[str, str], pass_env: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    """Start the engine with its output in `log_path`. Raises CannotStart."""
    argv = launched.launch.argv
    try:
        with open_private_log(log_path) as out:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=engine_environment({**extra_env, **launched.launch.env}, os.environ, pass_env),
                start_new_session=True,
            )
    except OSError as exc:
        what = exc.filename or argv[0]
        raise CannotStart(f"cannot start {argv[0]}: {what}: {exc.strerror}") from None


def distributed_env(assignment: ShardAssignment, engine_host: str) -> dict[str, str]:
    """For a replica of several shards: the interface its shards talk over, the one that
    holds the agent's engine address (NCCL and Gloo otherwise pick their own, often the
    wrong one on a host with several). The catalog's `env` may set them otherwise."""
    if assignment.num_shards <= 1:
        return {}
    interface = interface_of(engine_host)
    if interface is None:
        return {}
    return {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}
