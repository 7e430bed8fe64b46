"""The `modelfleet` command: every process of the fleet, and `ctl` for operators.

Each subcommand imports its service only when it runs, so starting an engine simulator does
not pay for the control plane's imports.
"""

from __future__ import annotations

import asyncio
import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

app = typer.Typer(
    help="modelfleet: serve LLMs on a fleet of GPU machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ctl_app = typer.Typer(help="Operate a running fleet through its admin API.", no_args_is_help=True)
catalog_app = typer.Typer(
    help="Show, change and list the fleet's catalog; no restart needed.", no_args_is_help=True
)
app.add_typer(ctl_app, name="ctl")
ctl_app.add_typer(catalog_app, name="catalog")

StateDir = Annotated[Path, typer.Option("--state-dir", help="Where the fleet keeps its state.")]
ReadyFile = Annotated[
    Path | None,
    typer.Option(help="Write {pid, urls} here as JSON once every listener accepts."),
]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning or error.")]


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def up(
    state_dir: StateDir = Path(".modelfleet"),
    router_port: Annotated[int, typer.Option(help="The router's port; 0 picks a free one.")] = 0,
) -> None:
    """Run a whole fleet on this machine: control plane, router, two agents, simulated engines."""
    from modelfleet.catalog import CatalogInvalid
    from modelfleet.up import UpError
    from modelfleet.up import up as run_up

    try:
        raise typer.Exit(run_up(state_dir, router_port=router_port))
    except (UpError, CatalogInvalid) as exc:
        _fail(str(exc), 1)


@app.command("control-plane")
def control_plane(
    config: Annotated[Path, typer.Option(help="The control plane's YAML config.")],
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run the control plane: agent API, admin API, reconcile loop, publisher."""
    from modelfleet.catalog import CatalogInvalid
    from modelfleet.config import ConfigError, load_config
    from modelfleet.controlplane.config import ControlPlaneConfig
    from modelfleet.controlplane.service import open_catalogs, serve
    from modelfleet.serving import configure_logging
    from modelfleet.store.sqlite import StoreError

    configure_logging(log_level)
    try:
        cfg = load_config(config, ControlPlaneConfig).resolve(config.parent)
        catalogs = open_catalogs(cfg)
    except (ConfigError, CatalogInvalid, StoreError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot read the catalog: {exc}")
    asyncio.run(serve(cfg, catalogs, ready_file))


@app.command()
def agent(
    control_plane: Annotated[str, typer.Option(help="The control plane's agent API URL.")],
    node: Annotated[str, typer.Option(help="This node's name.")],
    simulate_gpus: Annotated[
        str | None,
        typer.Option(
            help="Simulated GPUs, COUNTxSIZE[:MODEL][,...], e.g. 4x80GB. Without it the agent "
            "reads the node's NVIDIA GPUs through NVML."
        ),
    ] = None,
    token: Annotated[
        str | None, typer.Option(envvar="MODELFLEET_AGENT_TOKEN", help="The agent token.")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where the agent records its engines and logs.")
    ] = None,
    address: Annotated[str, typer.Option(help="Host at which this node's engines are reached.")] = (
        "127.0.0.1"
    ),
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
    report_interval: Annotated[float, typer.Option(help="Seconds between reports.")] = 2.0,
    stop_grace: Annotated[float, typer.Option(help="Seconds from SIGTERM to SIGKILL.")] = 30.0,
    backoff_base: Annotated[float, typer.Option(help="First restart delay, seconds.")] = 10.0,
    backoff_max: Annotated[float, typer.Option(help="Longest restart delay, seconds.")] = 300.0,
    healthy_reset: Annotated[
        float, typer.Option(help="Seconds ready after which the restart delay starts over.")
    ] = 600.0,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run a node's agent: report GPUs and shards, run the engines it is assigned."""
    from modelfleet.agent.gpus import (
        BadGpuSpec,
        GpuSource,
        NvmlGpus,
        NvmlUnavailable,
        SimulatedGpus,
    )
    from modelfleet.agent.service import AgentSettings, serve
    from modelfleet.agent.supervisor import SupervisorSettings
    from modelfleet.serving import configure_logging

    configure_logging(log_level)
    unhealthy: dict[int, str] = {}
    for item in unhealthy_gpu or []:
        index, sep, reason = item.partition("=")
        if not sep or not index.strip().isdigit():
            _fail(f"--unhealthy-gpu {item!r}: write INDEX=REASON, e.g. '3=XID 79'")
        unhealthy[int(index)] = reason.strip() or "marked unhealthy"
    gpus: GpuSource
    if simulate_gpus is None:
        if unhealthy:
            _fail("--unhealthy-gpu applies to simulated GPUs: give --simulate-gpus too")
        try:
            gpus = NvmlGpus()
        except NvmlUnavailable as exc:
            _fail(f"no GPUs to report: {exc}. Pass --simulate-gpus 4x80GB to simulate some.")
    else:
        try:
            gpus = SimulatedGpus(simulate_gpus, unhealthy)
        except BadGpuSpec as exc:
            _fail(f"--simulate-gpus: {exc}")
    labels = []
    for item in label or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--label {item!r}: write KEY=VALUE")
        labels.append((key, value))
    settings = AgentSettings(
        control_plane=control_plane,
        node=node,
        token=token,
        state_dir=state_dir or Path(".modelfleet") / "agents" / node,
        address=address,
        labels=tuple(labels),
        report_interval=report_interval,
        supervisor=SupervisorSettings(
            engine_host=address,
            stop_grace=stop_grace,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            healthy_reset=healthy_reset,
        ),
    )
    asyncio.run(serve(settings, gpus, ready_file, admin_port))


@app.command()
def router(
    config: Annotated[Path, typer.Option(help="The router's YAML config.")],
    ready_file: ReadyFile = None,
    log_level: LogLevel = "info",
) -> None:
    """Run the router: the OpenAI-compatible client API with API keys."""
    from modelfleet.config import ConfigError, load_config
    from modelfleet.router.service import RouterConfig, serve
    from modelfleet.serving import configure_logging

    configure_logging(log_level)
    try:
        cfg = load_config(config, RouterConfig)
    except ConfigError as exc:
        _fail(str(exc))
    asyncio.run(serve(cfg, ready_file))


@app.command("engine-sim")
def engine_sim(
    model: Annotated[str, typer.Option(help="The model name it serves.")],
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 8000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    ttft: Annotated[float, typer.Option(help="Seconds to first token, empty prompt.")] = 0.05,
    prefill_per_token: Annotated[float, typer.Option(help="Extra TTFT per prompt token.")] = 0.0001,
    itl: Annotated[float, typer.Option(help="Seconds between output tokens.")] = 0.01,
    max_concurrency: Annotated[int, typer.Option(help="Requests decoding at once.")] = 16,
    output_tokens: Annotated[int, typer.Option(help="Tokens when max_tokens is unset.")] = 16,
    startup_delay: Annotated[float, typer.Option(help="Seconds before listening.")] = 0.0,
    fault: Annotated[
        str,
        typer.Option(
            help="A fault to rehearse: none, exit-at-start (exits 1 after logging an error), "
            "never-ready (listens, but /health answers 503 forever)."
        ),
    ] = "none",
    drain_timeout: Annotated[
        float, typer.Option(help="Longest wait for in-flight on stop.")
    ] = 30.0,
    ready_file: ReadyFile = None,
    log_level: LogLevel = "warning",
) -> None:
    """Run the engine simulator: an OpenAI-compatible server that behaves like vLLM."""
    from modelfleet.serving import configure_logging
    from modelfleet.simulator.engine import FAULTS, SimSettings
    from modelfleet.simulator.server import serve

    if max_concurrency < 1:
        _fail("--max-concurrency must be at least 1")
    if fault not in FAULTS:
        _fail(f"--fault {fault!r}: one of {', '.join(FAULTS)}")
    configure_logging(log_level)
    settings = SimSettings(
        model=model,
        ttft=ttft,
        prefill_per_token=prefill_per_token,
        itl=itl,
        max_concurrency=max_concurrency,
        output_tokens=output_tokens,
        fault=fault,
    )
    asyncio.run(serve(settings, host, port, ready_file, startup_delay, drain_timeout))


class Output(StrEnum):
    table = "table"
    json = "json"


AdminUrl = Annotated[str | None, typer.Option("--admin", help="The admin API URL.")]
AdminToken = Annotated[str | None, typer.Option("--token", help="The admin token.")]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table or json.")]


def _ctl_get(path: str, admin: str | None, token: str | None, state_dir: Path) -> dict:
    from modelfleet.ctl import CtlError, get, resolve_target

    try:
        return get(resolve_target(admin, token, state_dir), path)
    except CtlError as exc:
        _fail(str(exc), 1)


def _show(data: dict, output: Output, printer_name: str) -> None:
    if output is Output.json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console

    from modelfleet import ctl

    getattr(ctl, printer_name)(data, Console(width=200))


@ctl_app.command()
def nodes(
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """The nodes, their GPUs and health."""
    _show(_ctl_get("/v1/nodes", admin, token, state_dir), output, "print_nodes")


replicas_app = typer.Typer(help="The replicas, their shards and state, and what is pending.")
ctl_app.add_typer(replicas_app, name="replicas")


@replicas_app.callback(invoke_without_command=True)
def replicas(
    context: typer.Context,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """The replicas, their shards and state, and the replicas that are pending."""
    if context.invoked_subcommand is None:
        _show(_ctl_get("/v1/replicas", admin, token, state_dir), output, "print_replicas")


@replicas_app.command("show")
def replicas_show(
    replica: Annotated[str, typer.Argument(help="A replica id, as `ctl replicas` lists it.")],
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """One replica: each shard's state, error, restarts, backoff and engine log tail."""
    from urllib.parse import quote

    path = "/v1/replicas/" + quote(replica, safe="")
    _show(_ctl_get(path, admin, token, state_dir), output, "print_replica")


@ctl_app.command("explain-placement")
def explain_placement(
    model: Annotated[str, typer.Argument(help="A model of the current catalog.")],
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """Where the model's next replica would go, or every node and why it was rejected."""
    from urllib.parse import quote

    path = "/v1/explain/" + quote(model, safe="")
    _show(_ctl_get(path, admin, token, state_dir), output, "print_explanation")


def _mark(
    node: str,
    mark: str,
    body: dict[str, Any],
    admin: str | None,
    token: str | None,
    state_dir: Path,
    output: Output,
) -> None:
    from urllib.parse import quote

    from modelfleet.ctl import CtlError, request, resolve_target

    path = f"/v1/nodes/{quote(node, safe='')}/mark"
    try:
        data = request(
            resolve_target(admin, token, state_dir),
            "POST",
            path,
            json.dumps({"mark": mark, **body}).encode(),
        )
    except CtlError as exc:
        _fail(str(exc), 1)
    _show(data, output, "print_mark")


NodeArg = Annotated[str, typer.Argument(help="The node's name, as `ctl nodes` shows it.")]


@ctl_app.command()
def cordon(
    node: NodeArg,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """Let nothing new land on NODE; what runs there stays."""
    _mark(node, "cordoned", {}, admin, token, state_dir, output)


@ctl_app.command()
def uncordon(
    node: NodeArg,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """Take the mark off NODE (cordoned or draining): replicas may land there again."""
    _mark(node, "none", {}, admin, token, state_dir, output)


@ctl_app.command()
def drain(
    node: NodeArg,
    grace: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Seconds to wait for replacements before stopping what is left anyway "
            "(default: the control plane's drain_grace; 0: wait without bound).",
        ),
    ] = None,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """Move every replica off NODE, make-before-break, and let nothing new land there."""
    body = {} if grace is None else {"grace_s": grace}
    _mark(node, "draining", body, admin, token, state_dir, output)


@catalog_app.command("show")
def catalog_show(
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """The current catalog with its version, and the last rejected attempt if any."""
    _show(_ctl_get("/v1/catalog", admin, token, state_dir), output, "print_catalog")


@catalog_app.command("history")
def catalog_history(
    limit: Annotated[int, typer.Option(min=1, help="How many versions, newest first.")] = 20,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """The last applied catalog versions with time, digest and source."""
    path = f"/v1/catalog/history?limit={limit}"
    _show(_ctl_get(path, admin, token, state_dir), output, "print_catalog_history")


@catalog_app.command("apply")
def catalog_apply(
    file: Annotated[Path, typer.Argument(help="A catalog file (YAML).")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would start and stop; change nothing.")
    ] = False,
    admin: AdminUrl = None,
    token: AdminToken = None,
    state_dir: StateDir = Path(".modelfleet"),
    output: OutputOpt = Output.table,
) -> None:
    """Make FILE the current catalog (or, with --dry-run, print the plan). An invalid catalog
    changes nothing: every problem is printed and the exit code is 1."""
    from modelfleet.ctl import CatalogRefused, CtlError, request, resolve_target

    try:
        content = file.read_bytes()
    except OSError as exc:
        _fail(f"cannot read {file}: {exc.strerror}", 1)
    path = "/v1/catalog" + ("?dry_run=true" if dry_run else "")
    try:
        data = request(resolve_target(admin, token, state_dir), "PUT", path, content)
    except CatalogRefused as exc:
        typer.echo(f"error: {file}: {exc}", err=True)
        for p in exc.problems:
            typer.echo(f"  - model {p['model']}: {p['field']}: {p['message']}", err=True)
        raise typer.Exit(1) from None
    except CtlError as exc:
        _fail(str(exc), 1)
    _show(data, output, "print_catalog_plan")


def main() -> None:
    app(prog_name="modelfleet")


if __name__ == "__main__":
    sys.exit(main())
