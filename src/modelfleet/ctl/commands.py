"""The `modelfleet ctl` command line: one command per admin API route.

`--admin`, `--token`, `--ca`, `--state-dir` and `-o` belong to `ctl` itself (one callback
takes them) and may be written before or after the command (`modelfleet` moves them first,
through `with_options_first`): `ctl -o json nodes` and `ctl nodes -o json` are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from pydantic import BaseModel
    from rich.console import Console

    from modelfleet.ctl.client import AdminClient

T = TypeVar("T", bound="BaseModel")


class Output(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"  # `ctl usage` only
    yaml = "yaml"  # `ctl catalog show` only: the catalog as a file `ctl catalog apply` takes


# ctl's own options, each taking a value: `with_options_first` moves them before the command.
# The -o forms only some commands have, and which.
_OWN_FORMS = {
    Output.csv: "-o csv is for `ctl usage`",
    Output.yaml: "-o yaml is for `ctl catalog show`",
}
_GLOBAL_OPTIONS = ("--admin", "--token", "--ca", "--state-dir", "--output", "-o")


def with_options_first(args: list[str]) -> list[str]:
    """ctl's arguments with its own options moved before the command, so that they may be
    written anywhere, as kubectl's are: `nodes -o json` becomes `-o json nodes`."""
    hoisted: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        if arg.split("=", 1)[0] in _GLOBAL_OPTIONS and "=" in arg:
            hoisted.append(arg)
        elif arg in _GLOBAL_OPTIONS and i + 1 < len(args):
            hoisted += args[i : i + 2]
            i += 1
        elif arg.startswith("-o") and not arg.startswith("--") and len(arg) > 2:
            hoisted.append(arg)
        else:
            rest.append(arg)
        i += 1
    return hoisted + rest


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@dataclass(frozen=True)
class Ctl:
    """What every ctl command is given: where the admin API is, and how to print."""

    admin: str | None
    token: str | None
    state_dir: Path
    output: Output
    ca: Path | None = None

    def connect(self) -> AdminClient:
        """The admin API's client; raises CtlError when the options name none."""
        from modelfleet.ctl.client import AdminClient, resolve_target

        return AdminClient(resolve_target(self.admin, self.token, self.state_dir, self.ca))

    def client(self) -> AdminClient:
        from modelfleet.ctl.client import CtlError

        try:
            return self.connect()
        except CtlError as exc:
            fail(str(exc), 1)

    def show(
        self,
        call: Callable[[AdminClient], T],
        render: Callable[[T, Console], None],
        forms: Mapping[Output, Callable[[T], str]] | None = None,
    ) -> None:
        """Call the admin API and print its answer (as JSON with `-o json`; in one of the
        command's own text `forms`, such as CSV, when `-o` names it)."""
        from modelfleet.ctl.client import CatalogRefused, CtlError

        form = (forms or {}).get(self.output)
        if self.output not in (Output.table, Output.json) and form is None:
            fail(_OWN_FORMS.get(self.output, "") + "; use -o table or -o json here")
        try:
            answer = call(self.client())
        except CatalogRefused:
            raise
        except CtlError as exc:
            fail(str(exc), 1)
        if self.output is Output.json:
            from modelfleet.ctl.render import as_json

            typer.echo(as_json(answer))
            return
        if form is not None:
            typer.echo(form(answer), nl=False)
            return
        from rich.console import Console

        render(answer, Console(width=200))


app = typer.Typer(
    help="Operate a running fleet through its admin API.",
    no_args_is_help=True,
)
catalog_app = typer.Typer(
    help="Show, change and list the fleet's catalog; no restart needed.", no_args_is_help=True
)
replicas_app = typer.Typer(help="The replicas, their shards and state, and what is pending.")
nodes_app = typer.Typer(help="The nodes, their GPUs and health; forget or revoke a node.")
join_tokens_app = typer.Typer(
    help="Join tokens: what an agent on a new machine joins the fleet with (--join, --token-file)."
)
keys_app = typer.Typer(
    help="Client API keys: make, list, change and revoke them while the fleet runs.",
    no_args_is_help=True,
)
app.add_typer(catalog_app, name="catalog")
app.add_typer(replicas_app, name="replicas")
app.add_typer(nodes_app, name="nodes")
app.add_typer(keys_app, name="keys")
app.add_typer(join_tokens_app, name="join-tokens")


@app.callback()
def options(
    context: typer.Context,
    admin: Annotated[
        str | None, typer.Option("--admin", help="The admin API URL (or MODELFLEET_ADMIN_URL).")
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="The admin token (or MODELFLEET_ADMIN_TOKEN).")
    ] = None,
    state_dir: Annotated[
        Path,
        typer.Option(
            "--state-dir",
            envvar="MODELFLEET_STATE_DIR",
            help="Where `modelfleet up` keeps its up.json (or MODELFLEET_STATE_DIR).",
        ),
    ] = Path(".modelfleet"),
    output: Annotated[Output, typer.Option("--output", "-o", help="table, json (csv, yaml).")] = (
        Output.table
    ),
    ca: Annotated[
        Path | None,
        typer.Option(
            "--ca",
            help="The control plane's CA certificate, to check an https:// admin API against "
            "(or MODELFLEET_CA; the control plane keeps it in its state dir, pki/ca.crt).",
        ),
    ] = None,
) -> None:
    """Operate a running fleet through its admin API."""
    context.obj = Ctl(admin, token, state_dir, output, ca)


def _ctl(context: typer.Context) -> Ctl:
    found = context.find_object(Ctl)
    assert found is not None, "the ctl callback sets it"
    return found


def _render(name: str) -> Callable[[Any, Console], None]:
    from modelfleet.ctl import render

    printer: Callable[[Any, Console], None] = getattr(render, name)
    return printer


@app.command()
def wait(
    context: typer.Context,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait at most.")] = 60,
) -> None:
    """Wait until the admin API answers: for a script that has just started the control
    plane. Any answer but "not there yet" (no answer, or no CA file yet: the control plane
    makes it as it starts) ends the wait at once with that error."""
    from modelfleet.ctl.client import CtlError, Unreachable

    ctl = _ctl(context)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ctl.connect().status()  # again each time: the CA file may not be there yet
            return
        except Unreachable as exc:
            if time.monotonic() >= deadline:
                fail(f"{exc} (waited {timeout:.0f}s)", 1)
        except CtlError as exc:
            fail(str(exc), 1)
        time.sleep(0.2)


@app.command()
def status(context: typer.Context) -> None:
    """Whether the control plane is settling or reconciling, and what is current."""
    _ctl(context).show(lambda c: c.status(), _render("print_status"))


@nodes_app.callback(invoke_without_command=True)
def nodes(context: typer.Context) -> None:
    """The nodes, their GPUs and health."""
    if context.invoked_subcommand is None:
        _ctl(context).show(lambda c: c.nodes(), _render("print_nodes"))


@nodes_app.command("delete")
def nodes_delete(
    context: typer.Context,
    node: Annotated[str, typer.Argument(help="The node's name, as `ctl nodes` shows it.")],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Delete it though replicas run on it: they are placed anew elsewhere."
        ),
    ] = False,
) -> None:
    """Forget NODE (one that is gone for good). Refused while replicas run on it, unless
    --force. An agent that reports again comes back as a new node."""
    _ctl(context).show(lambda c: c.delete_node(node, force), _render("print_deleted"))


@nodes_app.command("revoke")
def nodes_revoke(
    context: typer.Context,
    node: Annotated[str, typer.Argument(help="The node's name, as `ctl nodes` shows it.")],
) -> None:
    """Cut NODE off at once: its credential is deleted, so nothing it sends is taken, and its
    replicas are replaced elsewhere as a lost node's are. It comes back only by joining anew
    with a join token."""
    _ctl(context).show(lambda c: c.revoke_node(node), _render("print_node_revoked"))


@join_tokens_app.command("create")
def join_tokens_create(
    context: typer.Context,
    ttl: Annotated[
        str, typer.Option("--ttl", help="How long it can be used: 90m, 1h, 7d, or never.")
    ] = "1h",
    uses: Annotated[
        int,
        typer.Option("--uses", help="How many nodes may join with it (default: one)."),
    ] = 1,
    address: Annotated[
        list[str] | None,
        typer.Option(
            "--address",
            help="An IP address a node joining with it may advertise (and its certificate "
            "name) besides the one it joins from, e.g. behind NAT; repeatable. Never loopback.",
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print the token alone, for scripts.")
    ] = False,
) -> None:
    """Make a join token and print it, with the command an agent joins with. It is shown
    this once: the fleet keeps only a hash of its secret."""
    from modelfleet.messages import admin

    request = _key_request(admin.JoinTokenCreate, ttl=ttl, uses=uses, addresses=address)
    render = "print_join_token_alone" if quiet else "print_join_token_created"
    _ctl(context).show(lambda c: c.create_join_token(request), _render(render))


@join_tokens_app.command("list")
def join_tokens_list(context: typer.Context) -> None:
    """Every join token: id, state (usable, expired, used up), uses, created, expires."""
    _ctl(context).show(lambda c: c.join_tokens(), _render("print_join_tokens"))


@join_tokens_app.command("revoke")
def join_tokens_revoke(
    context: typer.Context,
    token_id: Annotated[str, typer.Argument(help="The token's id, as `join-tokens list` shows.")],
) -> None:
    """Delete a join token: no node joins with it after this (nodes that joined stay)."""
    _ctl(context).show(lambda c: c.revoke_join_token(token_id), _render("print_join_token_revoked"))


@app.command("credentials")
def credentials(context: typer.Context) -> None:
    """Every node credential given with a join token and not revoked, and whether its node
    has reported: one that never did is revoked by `ctl nodes revoke NODE` too."""
    _ctl(context).show(lambda c: c.credentials(), _render("print_credentials"))


@replicas_app.callback(invoke_without_command=True)
def replicas(context: typer.Context) -> None:
    """The replicas, their shards and state, and the replicas that are pending."""
    if context.invoked_subcommand is None:
        _ctl(context).show(lambda c: c.replicas(), _render("print_replicas"))


@replicas_app.command("show")
def replicas_show(
    context: typer.Context,
    replica: Annotated[str, typer.Argument(help="A replica id, as `ctl replicas` lists it.")],
) -> None:
    """One replica: each shard's state, error, restarts, backoff and engine log tail."""
    _ctl(context).show(lambda c: c.replica(replica), _render("print_replica"))


@app.command("explain-placement")
def explain_placement(
    context: typer.Context,
    model: Annotated[str, typer.Argument(help="A model of the current catalog.")],
) -> None:
    """Where the model's next replica would go, or every node and why it was rejected."""
    _ctl(context).show(lambda c: c.explain(model), _render("print_explanation"))


@app.command()
def rebalance(
    context: typer.Context,
    model: Annotated[
        str | None, typer.Argument(help="A model of the current catalog; every one if none.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would move.")] = False,
) -> None:
    """Spread replicas out again (after a drain and uncordon, say): while a node holds two
    replicas of a spread model more than another with room, the newest moves there,
    make-before-break and max_parallel at a time."""
    _ctl(context).show(lambda c: c.rebalance(model, dry_run), _render("print_rebalance"))


NodeArg = Annotated[str, typer.Argument(help="The node's name, as `ctl nodes` shows it.")]


def _mark(
    context: typer.Context,
    node: str,
    mark: str,
    grace: float | None = None,
    dry_run: bool = False,
) -> None:
    from pydantic import ValidationError

    from modelfleet.messages.admin import MarkRequest

    try:
        request = MarkRequest.model_validate({"mark": mark, "grace_s": grace, "dry_run": dry_run})
    except ValidationError:
        fail(f"--grace {grace}: give a number of seconds, 0 or more")
    _ctl(context).show(lambda c: c.mark(node, request), _render("print_mark"))


@app.command()
def cordon(context: typer.Context, node: NodeArg) -> None:
    """Let nothing new land on NODE; what runs there stays."""
    _mark(context, node, "cordoned")


@app.command()
def uncordon(context: typer.Context, node: NodeArg) -> None:
    """Take the mark off NODE (cordoned or draining): replicas may land there again."""
    _mark(context, node, "none")


@app.command()
def drain(
    context: typer.Context,
    node: NodeArg,
    grace: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Seconds to wait for replacements before stopping what is left anyway "
            "(default: the control plane's drain_grace; 0: wait without bound).",
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait", help="Wait until nothing runs on NODE, saying what is left and why."
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Only say what would move, and which replicas could not be replaced.",
        ),
    ] = False,
) -> None:
    """Move every replica off NODE, make-before-break, and let nothing new land there."""
    _mark(context, node, "draining", grace, dry_run)
    if wait and not dry_run:
        _wait_drained(_ctl(context), node)


def _wait_drained(ctl: Ctl, node: str) -> None:
    """Follow a drain until nothing runs on `node`: a line each time what is left changes,
    saying why each replica left there is still there."""
    from modelfleet.ctl.client import CtlError

    client = ctl.client()
    said = ""
    while True:
        try:
            replicas = client.replicas()
        except CtlError as exc:
            fail(str(exc), 1)
        left = [
            r
            for r in replicas.replicas
            if r.state != "retiring" and any(s.node == node for s in r.shards)
        ]
        if not left:
            typer.echo(f"node {node} drained: nothing runs there")
            return
        pending = {p.model: p for p in replicas.pending}
        lines = []
        for r in left:
            stuck = pending.get(r.model)
            if stuck is not None:
                lines.append(
                    f"  {r.id} ({r.model}): its replacement cannot be placed: {stuck.reason}"
                )
                lines += [f"    {v.node}: {'; '.join(v.reasons)}" for v in stuck.nodes if v.reasons]
            else:
                lines.append(f"  {r.id} ({r.model}): waiting for its replacement to serve")
        text = f"node {node}: {len(left)} replica(s) left\n" + "\n".join(lines)
        if text != said:
            typer.echo(text)
            said = text
        time.sleep(1.0)


@catalog_app.command("show")
def catalog_show(context: typer.Context) -> None:
    """The current catalog with its version, and the last rejected attempt if any. With
    -o yaml, the catalog as a file (every default filled in) that `ctl catalog apply` takes
    back as the same catalog."""
    from modelfleet.ctl import render

    _ctl(context).show(
        lambda c: c.catalog(), render.print_catalog, forms={Output.yaml: render.catalog_yaml}
    )


@catalog_app.command("history")
def catalog_history(
    context: typer.Context,
    limit: Annotated[
        int, typer.Option(min=1, max=1000, help="How many versions, newest first (at most 1000).")
    ] = 20,
) -> None:
    """The last applied catalog versions with time, digest and source."""
    _ctl(context).show(lambda c: c.catalog_history(limit), _render("print_catalog_history"))


@catalog_app.command("apply")
def catalog_apply(
    context: typer.Context,
    file: Annotated[Path, typer.Argument(help="A catalog file (YAML).")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would start and stop; change nothing.")
    ] = False,
) -> None:
    """Make FILE the current catalog (or, with --dry-run, print the plan). An invalid catalog
    changes nothing: every problem is printed and the exit code is 1."""
    from modelfleet.ctl.client import CatalogRefused

    try:
        content = file.read_bytes()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror}", 1)
    try:
        _ctl(context).show(
            lambda c: c.apply_catalog(content, dry_run), _render("print_catalog_plan")
        )
    except CatalogRefused as exc:
        typer.echo(f"error: {file}: {exc}", err=True)
        for p in exc.problems:
            typer.echo(f"  - model {p.model}: {p.field}: {p.message}", err=True)
        raise typer.Exit(1) from None


KeyNameArg = Annotated[str, typer.Argument(help="The key's name, as `ctl keys list` shows it.")]
ModelsOpt = Annotated[
    str | None,
    typer.Option("--models", help="The models it may use, comma-separated; every model if none."),
]
RpmOpt = Annotated[
    int | None,
    typer.Option(
        "--rpm",
        help="Requests in any 60 s at most, on every router together; never more (a request "
        "may be refused up to 2 s early).",
    ),
]
TpmOpt = Annotated[
    int | None,
    typer.Option(
        "--tpm",
        help="Tokens (prompt + completion) in any 60 s at most; a request reserves prompt + "
        "max_tokens until its usage is known.",
    ),
]
ConcurrentOpt = Annotated[
    int | None,
    typer.Option(
        "--max-concurrent",
        help="Requests in flight at once at most (a router that dies frees its within 30 s).",
    ),
]
ExpiresOpt = Annotated[
    str | None,
    typer.Option("--expires", help="When it stops working: 12h, 30d, 2w, or a date (2027-01-31)."),
]


def _key_request(model: type[T], **fields: Any) -> T:
    """The request, or a one-line error naming every bad option."""
    from pydantic import ValidationError

    given = {name: value for name, value in fields.items() if value is not None}
    if isinstance(given.get("models"), str):
        given["models"] = [m.strip() for m in given["models"].split(",") if m.strip()]
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{'.'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}"
            for e in exc.errors()
        )
        fail(problems)


@keys_app.command("create")
def keys_create(
    context: typer.Context,
    name: Annotated[str, typer.Argument(help="A name for the key: letters, digits, . _ -")],
    models: ModelsOpt = None,
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    max_concurrent: ConcurrentOpt = None,
    expires: ExpiresOpt = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print the key alone, for scripts.")
    ] = False,
) -> None:
    """Make a key and print it. It is shown this once: the fleet keeps only its hash."""
    from modelfleet.messages import admin

    request = _key_request(
        admin.KeyCreate,
        name=name,
        models=models,
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        expires=expires,
    )
    render = "print_key_alone" if quiet else "print_key_created"
    _ctl(context).show(lambda c: c.create_key(request), _render(render))


@keys_app.command("list")
def keys_list(context: typer.Context) -> None:
    """Every key: name, the first characters of the key, models, limits, created, expires."""
    _ctl(context).show(lambda c: c.keys(), _render("print_keys"))


@keys_app.command("update")
def keys_update(
    context: typer.Context,
    name: KeyNameArg,
    models: ModelsOpt = None,
    rpm: RpmOpt = None,
    tpm: TpmOpt = None,
    max_concurrent: ConcurrentOpt = None,
    expires: ExpiresOpt = None,
    clear: Annotated[
        list[str] | None,
        typer.Option(
            "--clear",
            help="Remove one: models (every model), rpm, tpm, max-concurrent, expires (never).",
        ),
    ] = None,
) -> None:
    """Change a key's models, limits or expiry; what is not named stays as it is."""
    from modelfleet.messages import admin

    request = _key_request(
        admin.KeyUpdate,
        models=models,
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        expires=expires,
        clear=[c.replace("-", "_") for c in clear] if clear else None,
    )
    _ctl(context).show(lambda c: c.update_key(name, request), _render("print_key"))


@keys_app.command("revoke")
def keys_revoke(context: typer.Context, name: KeyNameArg) -> None:
    """Revoke a key: every router refuses it within a push (about a second)."""
    _ctl(context).show(lambda c: c.revoke_key(name), _render("print_revoked"))


@app.command()
def logs(
    context: typer.Context,
    replica: Annotated[str, typer.Argument(help="The replica's id, as `ctl replicas` shows it.")],
    shard: Annotated[int, typer.Option("--shard", min=0, help="Which shard (rank).")] = 0,
    tail: Annotated[int, typer.Option("--tail", min=1, help="Lines from the end.")] = 200,
    previous: Annotated[
        int,
        typer.Option(
            "--previous", min=0, help="The output of that many runs back (before restarts)."
        ),
    ] = 0,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print what it writes, until ^C.")
    ] = False,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Only what it wrote in the last 10m, 1h, ... (with --tail)."),
    ] = None,
) -> None:
    """An engine's output, fetched from its node's agent through the control plane: works
    for a replica on any node, and keeps the runs before a restart (--previous K)."""
    from modelfleet.ctl.client import CtlError

    client = _ctl(context).client()
    try:
        got = client.logs(replica, shard, tail, previous, since=since)
        for line in got.lines:
            typer.echo(line)
        while follow:
            time.sleep(1.0)
            # By the shard, not one file: a restarted engine's new run follows its last.
            got = client.logs(replica, shard, tail, previous, offset=got.offset, run=got.run)
            for line in got.lines:
                typer.echo(line)
    except CtlError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        return


@app.command()
def events(
    context: typer.Context,
    regarding: Annotated[
        str | None,
        typer.Option(
            "--for", help="One object (node/NAME, model/NAME, replica/ID, key/NAME) or a kind."
        ),
    ] = None,
    since: Annotated[str, typer.Option("--since", help="From this long ago: 10m, 1h, 7d.")] = "1h",
    watch: Annotated[
        bool, typer.Option("--watch", help="Then print each new event as it comes, until ^C.")
    ] = False,
) -> None:
    """What happened, by when it was last seen (the latest last): changes (catalog applied,
    marks, replicas placed and stopped, nodes joined) and faults (shards failed, nodes lost,
    GPUs unhealthy). A repeat of the same event counts up. --for model/NAME takes its
    replicas' events too, --for node/NAME its shards'. -o json for tools."""
    from modelfleet.ctl import render
    from modelfleet.ctl.client import CtlError, ServerTrouble, Unreachable

    ctl = _ctl(context)
    if not watch:
        ctl.show(lambda c: c.events(regarding, since), render.print_events)
        return
    client = ctl.client()
    # A repeat counts up an event already shown: asked again by when events were last seen
    # (not by id, which a repeat keeps), each shown again when its count has grown.
    shown_counts: dict[int, int] = {}
    window = since
    lost_since: float | None = None  # while the control plane does not answer
    try:
        while True:
            asked_at = time.monotonic()
            try:
                got = client.events(regarding, window)
            except (Unreachable, ServerTrouble) as exc:
                # A control plane restarting, failing over or without its store: watch on,
                # and ask for what happened meanwhile once it answers again.
                if lost_since is None:
                    lost_since = asked_at
                    typer.echo(f"ctl: {exc}; watching on until it answers", err=True)
                window = f"{int(time.monotonic() - lost_since) + 10}s"
                time.sleep(1.0)
                continue
            except CtlError as exc:
                fail(str(exc), 1)
            if lost_since is not None:
                typer.echo("ctl: the control plane answers again", err=True)
                lost_since = None
            for e in got.events:
                if shown_counts.get(e.id) != e.count:
                    json_out = ctl.output is Output.json
                    typer.echo(e.model_dump_json() if json_out else render.event_line(e))
            # What left the window and comes back has counted up: it is shown again then.
            shown_counts = {e.id: e.count for e in got.events}
            time.sleep(1.0)
            window = f"{int(time.monotonic() - asked_at) + 10}s"  # the last poll's, and more
    except KeyboardInterrupt:
        return


@app.command()
def usage(
    context: typer.Context,
    key: Annotated[str | None, typer.Option("--key", help="One key's usage, by name.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="One model's usage.")] = None,
    since: Annotated[
        str, typer.Option("--since", help="From this long ago: 90m, 24h, 7d.")
    ] = "24h",
) -> None:
    """Requests, prompt and completion tokens and errors per key, model and hour, as the
    routers counted them (collected every few seconds). -o json or -o csv for tools."""
    from modelfleet.ctl import render

    _ctl(context).show(
        lambda c: c.usage(key, model, since),
        render.print_usage,
        forms={Output.csv: render.usage_csv},
    )
