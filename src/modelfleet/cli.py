"""The `modelfleet` command: every process of the fleet, and `ctl` (`ctl/commands.py`).

Each subcommand imports its service only when it runs, so starting an engine simulator does
not pay for the control plane's imports.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from modelfleet.ctl.commands import app as ctl_app
from modelfleet.ctl.commands import fail, with_options_first

if TYPE_CHECKING:
    from modelfleet.agent.credential import Credential, HeldToken
    from modelfleet.agent.gpus import GpuSource
    from modelfleet.agent.settings import EngineTls
    from modelfleet.security.pki import TlsFiles

log = logging.getLogger("modelfleet.controlplane")

STORE_RETRY_S = 2.0  # a control plane starting: how often it tries a store not reachable yet

app = typer.Typer(
    help="modelfleet: serve LLMs on a fleet of GPU machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(ctl_app, name="ctl")
install_app = typer.Typer(help="Install the fleet's processes as services.", no_args_is_help=True)
app.add_typer(install_app, name="install")


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print(f"modelfleet {version('modelfleet')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """modelfleet: serve LLMs on a fleet of GPU machines."""


StateDir = Annotated[Path, typer.Option("--state-dir", help="Where the fleet keeps its state.")]
ReadyFile = Annotated[
    Path | None,
    typer.Option(help="Write {pid, urls} here as JSON once every listener accepts."),
]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning or error.")]


@app.command()
def up(
    state_dir: StateDir = Path(".modelfleet"),
    router_port: Annotated[int, typer.Option(help="The router's port; 0 picks a free one.")] = 0,
    limits_store: Annotated[
        str | None,
        typer.Option(
            help="A Redis URL the router counts keys' limits in ('' for its own memory); "
            "kept for the next `up`."
        ),
    ] = None,
    redis: Annotated[
        bool | None,
        typer.Option(
            "--redis/--no-redis",
            help="Run Debian's redis-server in the state dir for the router's limits; kept.",
        ),
    ] = None,
    gpus: Annotated[
        str,
        typer.Option(
            help="Each node's simulated GPUs (COUNTxMEMORY), or `nvml`: this machine's own "
            "GPUs, read through NVML, as one node, or `cpu:CORES`: this machine's cores in "
            "slots of CORES (agent --cpu-slots), as one node.",
        ),
    ] = "4x80GB",
    control_planes: Annotated[
        int,
        typer.Option(
            min=1,
            max=9,
            help="Control planes on one store: one leads, the others take over when it stops "
            "(needs --store postgres or a PostgreSQL URL).",
        ),
    ] = 1,
    store: Annotated[
        str | None,
        typer.Option(
            help="The control planes' store: sqlite, postgres (Debian's PostgreSQL, run in the "
            "state dir) or a PostgreSQL URL; kept for the next `up`.",
        ),
    ] = None,
) -> None:
    """Run a whole fleet on this machine: control plane, router, two agents, simulated engines."""
    from modelfleet.core.catalog import CatalogInvalid
    from modelfleet.host.statedir import StateDirBusy
    from modelfleet.up import UpError
    from modelfleet.up import up as run_up

    try:
        raise typer.Exit(
            run_up(
                state_dir,
                router_port=router_port,
                limits_store=limits_store,
                redis=redis,
                gpus=gpus,
                control_planes=control_planes,
                store=store,
            )
        )
    except (UpError, CatalogInvalid, StateDirBusy) as exc:
        fail(str(exc), 1)


@app.command("control-plane")
def control_plane(
    config: Annotated[Path, typer.Option(help="The control plane's YAML config.")],
    insecure_agent_api: Annotated[
        bool,
        typer.Option(
            "--insecure-agent-api",
            help="Take reports with no credential at all (development only): any process "
            "that reaches the agent API can report as any node not joined on its own.",
        ),
    ] = False,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run the control plane: agent API, admin API, reconcile loop, publisher."""
    import gc

    gc.disable()  # until it serves (`service.keep_heap`): what the start makes lives for good
    from modelfleet.controlplane.config import ControlPlaneConfig
    from modelfleet.controlplane.service import (
        fleet_ca,
        listener_certificate,
        open_catalogs,
        serve,
    )
    from modelfleet.core.catalog import CatalogInvalid
    from modelfleet.host.config import ConfigError, load_config
    from modelfleet.host.statedir import StateDirBusy, StateDirLock
    from modelfleet.http.serving import configure_logging, run_fast
    from modelfleet.security.pki import PkiError
    from modelfleet.store import StoreError, StoreUnreachable

    configure_logging(log_level)
    try:
        cfg = load_config(config, ControlPlaneConfig).resolve(config.parent)
        if insecure_agent_api:
            cfg = cfg.model_copy(update={"insecure_agent_api": True})
        open_api = cfg.insecure_agent_api and cfg.agent_token is None
        warn_if_open(cfg.host, "the agent API", not open_api)
    except ConfigError as exc:
        fail(str(exc))
    try:
        lock = StateDirLock(cfg.state_dir, "control plane").acquire()
    except StateDirBusy as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot use the state dir {cfg.state_dir}, where the store lives: {exc}")
    # A store that cannot be reached yet is waited for (said once): a control plane started
    # while its PostgreSQL was down or frozen exited, and came back only if a supervisor
    # started it again. Anything else the store says (a newer schema, a refused password)
    # ends the start, naming it.
    waiting = ""
    while True:
        try:
            catalogs = open_catalogs(cfg)
            break
        except StoreUnreachable as exc:
            if not waiting:
                log.warning("%s; waiting for it (tried every %.0fs)", exc, STORE_RETRY_S)
            waiting = str(exc)
            time.sleep(STORE_RETRY_S)
        except (CatalogInvalid, StoreError) as exc:
            fail(str(exc))
        except OSError as exc:
            fail(f"cannot read the catalog file {cfg.catalog}: {exc}")
    if waiting:
        log.warning("the store answers: starting")
    try:
        ca = fleet_ca(cfg, catalogs.store)
        tls = listener_certificate(cfg, ca) if cfg.serves_tls else None
    except (PkiError, OSError, StoreError) as exc:
        fail(f"cannot make the control plane's CA or its listeners' certificate: {exc}")
    run_fast(serve(cfg, catalogs, ready_file, ca, tls))
    lock.release()


# The agent's options whose help runs long, named here so that the command reads at a glance.
JoinUrl = Annotated[
    str | None,
    typer.Option(
        "--join",
        help="Join the fleet whose agent API is at this URL with a join token (`ctl "
        "join-tokens create`; by --token-file or MODELFLEET_AGENT_TOKEN); the credential it "
        "is exchanged for is kept in the "
        "state dir and used from then on.",
    ),
]
ControlPlaneUrls = Annotated[
    str | None,
    typer.Option(
        "--control-plane",
        help="The control plane's agent API URL, for the fleet's shared agent token "
        "(the mode `up` runs in); other fleets use --join. Several control planes on one "
        "store: URL1,URL2,... (it reports to the one that leads).",
    ),
]
SimulatedGpus = Annotated[
    str | None,
    typer.Option(
        "--simulate-gpus",
        help="Simulated GPUs, COUNTxSIZE[:MODEL][,...], e.g. 4x80GB. Without it the agent "
        "reads the node's NVIDIA GPUs through NVML.",
    ),
]
CpuSlotsOption = Annotated[
    str | None,
    typer.Option(
        "--cpu-slots",
        help="A node without GPUs: offer its cores in slots: CORES or CORESxMEMORY each, e.g. "
        "4 or 4x16GB (default memory: the node's, shared evenly). Each engine runs on its "
        "slots' cores alone. Place models on them with gpu_model: CPU.",
    ),
]
AgentToken = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="MODELFLEET_AGENT_TOKEN",
        help="With --join: the join token (not needed once joined). With "
        "--control-plane: the fleet's shared agent token. Any local user can read a "
        "command line: give it by --token-file or MODELFLEET_AGENT_TOKEN instead.",
    ),
]
CaFile = Annotated[
    Path | None,
    typer.Option(
        "--ca",
        envvar="MODELFLEET_CA",
        help="The control plane's CA certificate, to check an https:// control plane "
        "against (its state dir's pki/ca.crt).",
    ),
]
EngineAddress = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="The address this node's engines listen on and routers reach them at. "
        "Default: this host's address on the route to the control plane (127.0.0.1 for "
        "a control plane on loopback).",
    ),
]
JoinEnvFile = Annotated[
    Path | None,
    typer.Option(
        "--env-file",
        help="With --join: the environment file its service reads MODELFLEET_AGENT_TOKEN from "
        "(`install systemd` gives it): once joined, the agent rewrites it without the token.",
    ),
]
ReportInterval = Annotated[
    float,
    typer.Option(
        "--report-interval",
        help="Seconds between tries while the control plane cannot be reached (once "
        "reached, it sets how often the agent beats).",
    ),
]
PassEnv = Annotated[
    list[str] | None,
    typer.Option(
        "--pass-env",
        help="A variable of the agent's environment to pass on to engines (besides PATH, "
        "HOME, locale, library and cache paths); repeatable.",
    ),
]
EnginePrograms = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-program",
        help="ENGINE=COMMAND: the command that runs ENGINE on this node, e.g. "
        "vllm=/opt/vllm/bin/vllm or 'sglang=/opt/sgl/bin/python -m sglang.launch_server' "
        "(default: vllm and llama-server from PATH, SGLang and llama-cpp-python in the "
        "agent's Python). A model's `program` in the catalog goes before it; repeatable.",
    ),
]


@app.command()
def agent(
    node: Annotated[str, typer.Option(help="This node's name.")],
    join: JoinUrl = None,
    control_plane: ControlPlaneUrls = None,
    simulate_gpus: SimulatedGpus = None,
    cpu_slots: CpuSlotsOption = None,
    token: AgentToken = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="A file holding --token (readable by its owner alone). With --join, once "
            "joined, the agent rewrites it without the token (it needs it no more)."
        ),
    ] = None,
    env_file: JoinEnvFile = None,
    ca: CaFile = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where the agent records its engines and logs.")
    ] = None,
    address: EngineAddress = None,
    label: Annotated[
        list[str] | None, typer.Option(help="A node label KEY=VALUE; repeatable.")
    ] = None,
    unhealthy_gpu: Annotated[
        list[str] | None,
        typer.Option(help="Mark a simulated GPU unhealthy: INDEX=REASON; repeatable."),
    ] = None,
    admin_port: Annotated[
        int | None,
        typer.Option(help="Serve the agent's admin API (simulated GPU faults) here; 0: any."),
    ] = None,
    report_interval: ReportInterval = 2.0,
    stop_grace: Annotated[float, typer.Option(help="Seconds from SIGTERM to SIGKILL.")] = 30.0,
    backoff_base: Annotated[float, typer.Option(help="First restart delay, seconds.")] = 10.0,
    backoff_max: Annotated[float, typer.Option(help="Longest restart delay, seconds.")] = 300.0,
    healthy_reset: Annotated[
        float, typer.Option(help="Seconds ready after which the restart delay starts over.")
    ] = 600.0,
    liveness_interval: Annotated[
        float, typer.Option(help="Seconds between health probes of a ready engine.")
    ] = 5.0,
    liveness_timeout: Annotated[
        float, typer.Option(help="Seconds a health probe of a ready engine may take.")
    ] = 2.0,
    pass_env: PassEnv = None,
    liveness_failures: Annotated[
        int,
        typer.Option(min=1, help="Failed probes in a row after which a ready engine restarts."),
    ] = 3,
    engine_program: EnginePrograms = None,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run a node's agent: report GPUs and shards, run the engines it is assigned."""
    from modelfleet.agent.gpus import CpuSlots
    from modelfleet.agent.service import serve
    from modelfleet.agent.settings import AgentSettings, SupervisorSettings
    from modelfleet.host.statedir import StateDirBusy, StateDirLock
    from modelfleet.http.serving import configure_logging, run_service_loop

    configure_logging(log_level)
    gpus = _gpu_source(simulate_gpus, cpu_slots, unhealthy_gpu or [])
    labels = _labels(label or [])
    if token_file is not None:
        if token is not None:
            fail("give --token (or MODELFLEET_AGENT_TOKEN) or --token-file, not both")
        # Emptied by the agent once joined: then the credential kept is what it runs on.
        token = _secret_from(token_file, "--token-file", may_be_empty=join is not None)
    agent_dir = state_dir or Path(".modelfleet") / "agents" / node
    try:
        lock = StateDirLock(agent_dir, f"the agent of {node}").acquire()
    except (StateDirBusy, OSError) as exc:
        fail(str(exc))
    files = tuple(f for f in (token_file, env_file) if f is not None)
    link = _link(node, join, control_plane, token, ca, address, agent_dir, report_interval, files)
    del token  # the join token, if any, is held by `link.join_token` alone from here on
    if admin_port is not None and link.admin_tls is None and not link.loopback:
        fail(
            f"the admin API would serve plain HTTP on {link.address}: plain HTTP stays on "
            "loopback. Join with --join for a certificate, or leave --admin-port out"
        )
    settings = AgentSettings(
        control_plane=link.url,
        control_planes=link.urls,
        node=node,
        token=link.token,
        join_token=link.join_token,
        verify=link.verify,
        admin_tls=link.admin_tls,
        state_dir=agent_dir,
        address=link.address,
        labels=labels,
        report_interval=report_interval,
        supervisor=SupervisorSettings(
            engine_host=link.address,
            engine_tls=link.engine_tls,
            stop_grace=stop_grace,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            healthy_reset=healthy_reset,
            liveness_interval=liveness_interval,
            liveness_timeout=liveness_timeout,
            liveness_failures=liveness_failures,
            pass_env=tuple(pass_env or ()),
            programs=_engine_programs(engine_program or []),
            cpu_slots=gpus.slots if isinstance(gpus, CpuSlots) else {},
        ),
    )
    run_service_loop(serve(settings, gpus, ready_file, admin_port))
    lock.release()


def _labels(items: list[str]) -> tuple[tuple[str, str], ...]:
    """`--label KEY=VALUE` items as pairs; fails naming the item that is not one."""
    labels = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--label {item!r}: write KEY=VALUE")
        labels.append((key, value))
    return tuple(labels)


@dataclass(frozen=True)
class _Link:
    """How an agent reaches its control plane and proves who it is, and where its engines
    are reached."""

    url: str
    urls: tuple[str, ...]
    address: str
    loopback: bool
    token: str | None
    join_token: HeldToken
    verify: ssl.SSLContext | None
    admin_tls: TlsFiles | None
    engine_tls: EngineTls | None


def _link(
    node: str,
    join: str | None,
    control_plane: str | None,
    token: str | None,
    ca: Path | None,
    address: str | None,
    agent_dir: Path,
    report_interval: float,
    token_files: tuple[Path, ...] = (),
) -> _Link:
    """The agent's link from its options: joined with a join token (a credential of its own,
    kept in `agent_dir`, and the fleet's CA), or on the shared agent token. A join token just
    exchanged is forgotten at once (also in `token_files`, the files it was given in); one
    given beside a kept credential is held until the control plane takes that credential or
    refuses it (then the agent joins anew with it)."""
    from modelfleet.agent.credential import HeldToken, forget_join_token
    from modelfleet.agent.settings import EngineTls
    from modelfleet.security.pki import client_context, is_loopback

    urls = [u.strip() for u in control_plane.split(",") if u.strip()] if control_plane else []
    url = join or (urls[0] if urls else None)
    if url is None or (join and control_plane):
        fail("give --join URL (with a join token) or --control-plane URL (shared agent token)")
    if address is None:
        address = _address_towards(url)
    if join is None:
        return _Link(
            url, tuple(urls), address, is_loopback(address), token, HeldToken(),
            _ca_context(url, ca), None, None,
        )  # fmt: skip
    joined, fresh = _joined(join, token, node, address, agent_dir, report_interval)
    held = HeldToken(token, token_files)
    if fresh:
        forget_join_token(held)
    admin_tls = joined.tls_files(agent_dir)
    engine_tls = None
    if not is_loopback(address):  # engines other machines reach: behind gates
        engine_tls = EngineTls(admin_tls, joined.ca_file(agent_dir))
    verify = client_context(joined.ca.encode())
    return _Link(
        url, tuple(urls), address, is_loopback(address), joined.credential, held, verify,
        admin_tls, engine_tls,
    )  # fmt: skip


def _gpu_source(simulated: str | None, cpu_slots: str | None, unhealthy: list[str]) -> GpuSource:
    """The agent's GPUs from its options: simulated, CPU slots, or NVML's (the default)."""
    from modelfleet.agent.gpus import (
        BadGpuSpec,
        CpuSlots,
        NvmlGpus,
        NvmlUnavailable,
        SimulatedGpus,
    )

    marked: dict[int, str] = {}
    for item in unhealthy:
        index, sep, reason = item.partition("=")
        if not sep or not index.strip().isdigit():
            fail(f"--unhealthy-gpu {item!r}: write INDEX=REASON, e.g. '3=XID 79'")
        marked[int(index)] = reason.strip() or "marked unhealthy"
    if simulated is not None and cpu_slots is not None:
        fail("give --simulate-gpus or --cpu-slots, not both")
    if marked and simulated is None:
        fail("--unhealthy-gpu applies to simulated GPUs: give --simulate-gpus too")
    try:
        if simulated is not None:
            return SimulatedGpus(simulated, marked)
        if cpu_slots is not None:
            return CpuSlots(cpu_slots)
    except BadGpuSpec as exc:
        fail(f"--{'simulate-gpus' if simulated is not None else 'cpu-slots'}: {exc}")
    try:
        return NvmlGpus()
    except NvmlUnavailable as exc:
        fail(
            f"no GPUs to report: {exc}. Pass --cpu-slots 4 to offer this node's cores, or "
            "--simulate-gpus 4x80GB to simulate GPUs."
        )


def _engine_programs(items: list[str]) -> dict[str, str]:
    """`--engine-program ENGINE=COMMAND` items by engine; fails naming the item that is not
    one, or whose program is not on this node."""
    from modelfleet.engines import DRIVERS

    engines = sorted(name for name in DRIVERS if name != "command")
    programs: dict[str, str] = {}
    for item in items:
        engine, sep, command = item.partition("=")
        if not sep or engine not in engines:
            fail(f"--engine-program {item!r}: write ENGINE=COMMAND, ENGINE one of {engines}")
        try:
            words = shlex.split(command)
        except ValueError as exc:
            fail(f"--engine-program {item!r}: {exc}")
        if not words or shutil.which(words[0]) is None:
            fail(f"--engine-program {item!r}: {words[:1]} is not a program on this node")
        programs[engine] = command
    return programs


@app.command()
def router(
    config: Annotated[Path, typer.Option(help="The router's YAML config.")],
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="The client API's TLS certificate (PEM), instead of the config's."),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="Its private key (PEM), instead of the config's.")
    ] = None,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run the router: the OpenAI-compatible client API with API keys."""
    from pydantic import ValidationError

    from modelfleet.host.config import ConfigError, load_config
    from modelfleet.http.serving import configure_logging, run_fast
    from modelfleet.router.config import RouterConfig
    from modelfleet.router.service import serve
    from modelfleet.router.workers import PortHeld
    from modelfleet.security.pki import PkiError, server_context

    configure_logging(log_level)
    try:
        cfg = load_config(config, RouterConfig)
    except ConfigError as exc:
        fail(str(exc))
    if tls_cert is not None or tls_key is not None:
        given = {"tls_cert": tls_cert, "tls_key": tls_key}
        try:
            cfg = RouterConfig.model_validate({**cfg.model_dump(), **given})
        except ValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            fail(f"--tls-cert/--tls-key: {problems}")
    for files in (cfg.client_tls, cfg.push_tls):
        if files is None:
            continue
        try:
            server_context(files)  # a missing or mismatched file: said now, not as a traceback
        except PkiError as exc:
            fail(f"{config}: {exc}")
    if not cfg.api_keys and cfg.push_token is None:
        typer.echo(
            f"warning: {config} has no api_keys and no push_token (for keys the control plane "
            "manages): every request will be refused (401)",
            err=True,
        )
    try:
        run_fast(serve(cfg, ready_file))
    except PortHeld as exc:
        fail(str(exc))


@app.command()
def certificate(
    state_dir: Annotated[
        Path, typer.Option(help="The control plane's state dir, which holds the fleet's CA.")
    ],
    name: Annotated[
        list[str],
        typer.Option(help="A DNS name or IP address the server is reached by; repeatable."),
    ],
    out: Annotated[Path, typer.Option(help="The folder to write STEM.crt and STEM.key to.")],
    stem: Annotated[str, typer.Option(help="The files' name.")] = "server",
    days: Annotated[int, typer.Option(min=1, help="Days it is valid.")] = 365,
) -> None:
    """Issue a TLS certificate from the fleet's CA, for a router's listeners: run it where
    the control plane's state dir is (the CA's key never leaves it)."""
    import datetime

    from modelfleet.controlplane.config import PKI_DIR
    from modelfleet.security.pki import CA_CERT, CA_KEY, CertificateAuthority, PkiError

    folder = state_dir / PKI_DIR
    if not (folder / CA_KEY).exists():
        fail(f"no CA in {folder}: start the control plane once with this state dir (it makes one)")
    try:
        ca = CertificateAuthority.load(folder / CA_CERT, folder / CA_KEY)
        now = datetime.datetime.now(datetime.UTC)
        files = ca.issue(name, now, days=days).write(out, stem)
    except (PkiError, OSError) as exc:
        fail(str(exc))
    typer.echo(f"{files.cert}\n{files.key}  (0600)\nissued by the CA {ca.fingerprint}")


@install_app.command(
    "systemd", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def install_systemd(
    context: typer.Context,
    role: Annotated[str, typer.Option(help="control-plane, router or agent.")],
    out: Annotated[Path, typer.Option(help="The folder to write the unit (and env file) to.")],
    env_dir: Annotated[
        Path,
        typer.Option(help="Where the env file (0600) will live, for the unit to name."),
    ] = Path("/etc/modelfleet"),
    user: Annotated[
        str,
        typer.Option(
            help="Run the service as this user (`root`: as root); a sysusers.d file "
            "that makes it is written beside the unit."
        ),
    ] = "modelfleet",
    program: Annotated[
        Path | None,
        typer.Option(
            help="The `modelfleet` executable the unit runs (absolute; the user must "
            "be able to run it). By default the one beside this Python."
        ),
    ] = None,
) -> None:
    """Write a systemd unit running `modelfleet ROLE` with the options given after `--`,
    e.g. `install systemd --role agent --out DIR -- --control-plane URL --node gpu-1 --ca
    FILE --token T`. Secrets (the agent's --token) go to an env file of mode 0600."""
    from modelfleet.host.install import (
        ROLES,
        InstallError,
        check_runnable,
        systemd_unit,
        write_unit,
    )

    if role not in ROLES:
        fail(f"--role {role!r}: one of {', '.join(ROLES)}")
    runs_as = None if user == "root" else user
    beside = Path(sys.executable).parent / "modelfleet"
    command = [str(program or beside)] if program or beside.exists() else None
    try:
        check_runnable(Path(command[0]) if command else Path(sys.executable), runs_as)
        unit = systemd_unit(
            role,  # checked against ROLES above
            list(context.args),
            env_dir.absolute(),
            program=command,
            user=runs_as,
        )
        written = write_unit(unit, out)
    except (InstallError, OSError) as exc:
        fail(str(exc))
    for path in written:
        typer.echo(path)
    steps = []
    if runs_as is not None:
        steps.append(f"cp {out}/sysusers.d/{runs_as}.conf /etc/sysusers.d/ && systemd-sysusers")
    if unit.env_name is not None:
        # The agent's own, for it to rewrite without the join token once joined.
        owner = f"-o {runs_as} -g {runs_as} " if role == "agent" and runs_as else ""
        source, target = out / unit.env_name, env_dir / unit.env_name
        steps.append(f"install -D -m 600 {owner}{source} {target}")
    steps.append(f"cp {written[0]} /etc/systemd/system/ && systemctl daemon-reload")
    steps.append(f"systemctl enable --now {unit.name}")
    typer.echo("then: " + " && ".join(steps))


@app.command(
    "engine-gate",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def engine_gate(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option(help="HOST:PORT the gate serves TLS on.")],
    engine_port: Annotated[int, typer.Option(help="The engine's port on 127.0.0.1.")],
    cert: Annotated[Path, typer.Option(help="The node's certificate (PEM).")],
    key: Annotated[Path, typer.Option(help="Its private key (PEM).")],
    ca: Annotated[Path, typer.Option(help="The fleet's CA: routers' certificates of it pass.")],
    max_connections: Annotated[
        int, typer.Option(min=1, help="Connections at once, TLS handshakes under way included.")
    ] = 4096,
) -> None:
    """Start an engine (the command after `--`) on loopback behind a TLS gate that lets in
    only the fleet's routers; exit as the engine exits. The agent runs it for every engine
    other machines reach."""
    from modelfleet.agent.gate import GateSettings, run_gate
    from modelfleet.http.serving import configure_logging
    from modelfleet.security.pki import TlsFiles

    configure_logging("info")
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        fail(f"--listen {listen!r}: give HOST:PORT")
    if not ctx.args:
        fail("give the engine's command after --")
    settings = GateSettings(host.strip("[]"), int(port), engine_port, TlsFiles(cert, key), ca,
                            list(ctx.args), max_connections)  # fmt: skip
    raise typer.Exit(run_gate(settings))


@app.command("engine-sim")
def engine_sim(
    model: Annotated[str, typer.Option(help="The model name it serves.")],
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 8000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    ttft: Annotated[float, typer.Option(help="Seconds to first token, empty prompt.")] = 0.05,
    prefill_per_token: Annotated[float, typer.Option(help="Extra TTFT per prompt token.")] = 0.0001,
    itl: Annotated[float, typer.Option(help="Seconds between output tokens.")] = 0.01,
    max_concurrency: Annotated[int, typer.Option(help="Requests decoding at once.")] = 16,
    kv_cache_tokens: Annotated[
        int, typer.Option(help="The KV cache: tokens the running requests may hold.")
    ] = 32768,
    output_tokens: Annotated[int, typer.Option(help="Tokens when max_tokens is unset.")] = 16,
    startup_delay: Annotated[float, typer.Option(help="Seconds before listening.")] = 0.0,
    fault: Annotated[
        str,
        typer.Option(
            help="A fault to rehearse: none, exit-at-start (exits 1 after logging an error), "
            "never-ready (listens, but /health answers 503 forever)."
        ),
    ] = "none",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MODELFLEET_ENGINE_KEY",
            help="Answer /v1 requests only with `Authorization: Bearer KEY` (its agent gives "
            "it one by environment).",
        ),
    ] = None,
    hang_after: Annotated[
        float | None,
        typer.Option(
            help="A hung engine to rehearse: after SECONDS it answers nothing, /health "
            "included, and keeps running."
        ),
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option(help="Longest wait for in-flight on stop.")
    ] = 30.0,
    prefix_cache_blocks: Annotated[
        int,
        typer.Option(
            help="Blocks of 16 prompt tokens its prefix cache keeps (LRU); cached leading "
            "blocks cost no prefill. 0: no cache."
        ),
    ] = 4096,
    max_model_len: Annotated[
        int,
        typer.Option(
            help="Prompt and output tokens a request may hold together (vLLM's "
            "--max-model-len); past it a request gets 400."
        ),
    ] = 8192,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            help="Send a span per request, the child of its traceparent, to this OTLP/HTTP "
            "traces URL (as vLLM's --otlp-traces-endpoint).",
        ),
    ] = None,
    sleep_mode: Annotated[
        bool,
        typer.Option(
            "--enable-sleep-mode",
            help="vLLM's sleep mode: POST /sleep?level=1|2 frees the GPU, POST /wake_up "
            "serves again, GET /is_sleeping; requests meanwhile get 503.",
        ),
    ] = False,
    sleep_delay: Annotated[
        float, typer.Option(help="Seconds to fall asleep, once in-flight requests ended.")
    ] = 0.2,
    wake_delay: Annotated[
        float, typer.Option(help="Seconds to wake up (twice this from a level-2 sleep).")
    ] = 1.0,
    enable_lora: Annotated[
        bool,
        typer.Option(
            "--enable-lora",
            help="vLLM's LoRA adapters loaded at run time: POST /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter; a request names an adapter it holds as its model.",
        ),
    ] = False,
    max_loras: Annotated[
        int, typer.Option(help="Adapters held at once; the least recently used goes.")
    ] = 4,
    lora_load_delay: Annotated[float, typer.Option(help="Seconds to load an adapter.")] = 0.5,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "warning",
) -> None:
    """Run the engine simulator: an OpenAI-compatible server that behaves like vLLM."""
    from modelfleet.http.serving import configure_logging, run_fast
    from modelfleet.simulator.engine import FAULTS, SimSettings

    warn_if_open(host, "the engine", api_key is not None)
    from modelfleet.simulator.server import serve

    if max_concurrency < 1:
        fail("--max-concurrency must be at least 1")
    if kv_cache_tokens < 1:
        fail("--kv-cache-tokens must be at least 1")
    if fault not in FAULTS:
        fail(f"--fault {fault!r}: one of {', '.join(FAULTS)}")
    if prefix_cache_blocks < 0:
        fail("--prefix-cache-blocks must be 0 or more")
    if max_model_len < 2:
        fail("--max-model-len must be at least 2")
    if sleep_delay < 0 or wake_delay < 0:
        fail("--sleep-delay and --wake-delay are seconds: 0 or more")
    if max_loras < 1:
        fail("--max-loras must be at least 1")
    if lora_load_delay < 0:
        fail("--lora-load-delay is seconds: 0 or more")
    configure_logging(log_level)
    settings = SimSettings(
        model=model,
        ttft=ttft,
        prefill_per_token=prefill_per_token,
        itl=itl,
        max_concurrency=max_concurrency,
        kv_cache_tokens=kv_cache_tokens,
        output_tokens=output_tokens,
        fault=fault,
        hang_after=hang_after,
        api_key=api_key,
        prefix_cache_blocks=prefix_cache_blocks,
        max_model_len=max_model_len,
        otlp_endpoint=otlp_endpoint,
        sleep_mode=sleep_mode,
        sleep_delay=sleep_delay,
        wake_delay=wake_delay,
        enable_lora=enable_lora,
        max_loras=max_loras,
        lora_load_delay=lora_load_delay,
    )
    run_fast(serve(settings, host, port, ready_file, startup_delay, drain_timeout))


def _secret_from(path: Path, option: str, may_be_empty: bool = False) -> str | None:
    """The secret in file `path`, which its group and others may not read; None for an
    empty file where it `may_be_empty`."""
    from modelfleet.host.config import ConfigError, owner_only

    try:
        owner_only(path, ["the token"])
        text = path.read_text().strip()
    except ConfigError as exc:
        fail(f"{option}: {exc}")
    except OSError as exc:
        fail(f"{option}: cannot read {path}: {exc.strerror}")
    if not text:
        if may_be_empty:
            return None
        fail(f"{option}: {path} is empty")
    return text


def _ca_context(url: str, ca: Path | None) -> ssl.SSLContext | None:
    """How an agent on the shared token checks an https:// control plane: against `ca`."""
    from modelfleet.security.pki import PkiError, client_context

    if not url.startswith("https://"):
        return None
    if ca is None:
        fail(
            f"--control-plane {url} serves TLS: give --ca FILE, the control plane's CA "
            "certificate (its state dir's pki/ca.crt), to check it against"
        )
    try:
        return client_context(ca.read_bytes())
    except (OSError, PkiError) as exc:
        fail(f"--ca {ca}: {exc}")


def _joined(
    url: str, token: str | None, node: str, address: str, state_dir: Path, retry_every: float
) -> tuple[Credential, bool]:
    """The credential this agent joined with before, or the one it joins with now; whether
    it joined now."""
    from modelfleet.agent.credential import JoinFailed, join_until_answered, load
    from modelfleet.security.joining import BadJoinToken, JoinToken
    from modelfleet.security.pki import PkiError

    try:
        kept = load(state_dir)
        if kept is not None:
            if kept.node != node:
                fail(
                    f"{state_dir} holds the credential of node {kept.node}, not {node}: give "
                    "this node a state dir of its own"
                )
            return kept, False
        if token is None:
            fail(
                "--join needs a join token (`modelfleet ctl join-tokens create`): give it by "
                "--token-file FILE or MODELFLEET_AGENT_TOKEN"
            )
        parsed = JoinToken.parse(token)
        joined = join_until_answered(url, parsed, node, [address], state_dir, retry_every)
    except BadJoinToken as exc:
        fail(f"--token: {exc}")
    except (JoinFailed, PkiError, OSError) as exc:
        fail(f"cannot join: {exc}")
    typer.echo(
        f"joined the fleet at {url} as node {node}; its certificate names "
        f"{', '.join(joined.names())}",
        err=True,
    )
    return joined, True


def _address_towards(url: str) -> str:
    """This host's address on its route to the host of `url`: where peers on that network
    reach it. 127.0.0.1 for a loopback URL."""
    from urllib.parse import urlsplit

    from modelfleet.host.network import route_address
    from modelfleet.security.pki import is_loopback

    host = urlsplit(url).hostname
    if host is None:
        fail(f"--control-plane {url!r}: give a URL such as https://cp.example:7070")
    if is_loopback(host):
        return "127.0.0.1"
    try:
        address = route_address(host)
    except OSError as exc:
        fail(f"cannot tell which address of this host reaches {host} ({exc}): give --address")
    typer.echo(f"engines listen on {address}, this host's address towards {host}", err=True)
    return address


def warn_if_open(host: str, listener: str, credential: bool) -> None:
    """A listener bound beyond loopback with no credential is open to the network: say so."""
    if not credential and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(
            f"warning: {listener} listens on {host} with no credential: anyone who reaches it "
            "can use it",
            err=True,
        )


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["ctl"]:
        args = ["ctl", *with_options_first(args[1:])]
    app(args=args, prog_name="modelfleet")


if __name__ == "__main__":
    main()
