"""How `ctl` prints the admin API's answers as tables (`-o json` prints them as they came)."""

from __future__ import annotations

import csv
import io
import json
import re
import time

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelfleet.core.units import format_size
from modelfleet.messages import admin

# C0 and C1 control characters, and the marks that turn text around (the "Trojan source" ones).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def shown(text: str) -> str:
    """`text` that an agent or a client chose (a node's name, a GPU's model, a reason), for
    a terminal: a control character written as its escape (`\\x1b`), never sent as it is (an
    escape sequence in a node's name could rewrite the operator's screen or title), and rich's
    markup (`[red]`) escaped, so that it prints as it was sent."""
    return escape(_CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text))


def as_json(answer: BaseModel) -> str:
    """An answer as `-o json` prints it: every field, an unset one as null (a catalog
    printed so is taken back by `ctl catalog apply` as the same catalog)."""
    return json.dumps(answer.model_dump(mode="json"), indent=2)


def gpu_state(gpu: admin.GpuInfo) -> str:
    if not gpu.healthy:
        return f"unhealthy ({shown(gpu.reason or 'no reason given')})"
    return "used" if gpu.in_use else "free"


def print_status(data: admin.StatusAnswer, console: Console) -> None:
    doing = "settling: waiting for agents to report" if data.settling else "reconciling"
    console.print(
        f"control plane {doing}; {data.reconcile_passes} pass(es), "
        f"{data.reconcile_plans} of them planned{_pass_times(data)}\n"
        f"agents beat every {data.heartbeat_interval:g}s\n"
        f"catalog version {data.catalog_version}, routing version {data.routing_version}\n"
        f"{data.nodes} node(s), {data.replicas} replica(s) ({data.failed} failed), "
        f"{data.pending} pending",
        highlight=False,
    )
    if data.store:
        role = "leads" if data.leading else f"follows {data.leader or '(no leader yet)'}"
        console.print(
            f"store {data.store}; this control plane {role} (lease epoch {data.lease_epoch})",
            highlight=False,
        )
    if len(data.control_planes) > 1:
        table = Table("CONTROL PLANE", "ROLE", "ADMIN API", "LAST SEEN")
        for plane in data.control_planes:
            role = "leader" if plane.leads else "follower"
            table.add_row(
                escape(plane.name) + (" (this one)" if plane.answering else ""),
                role,
                escape(plane.admin_url),
                f"{plane.seen_ago_s:.1f}s ago",
            )
        console.print(table)
    print_scaling(data.scaling, console)
    if data.frozen:
        console.print(f"warning: {data.frozen}", highlight=False)
    if data.store_problem:
        console.print(f"warning: {data.store_problem}", highlight=False)
    if data.lease_refused:
        console.print(f"warning: this control plane {data.lease_refused}", highlight=False)


def _pass_times(data: admin.StatusAnswer) -> str:
    times = []
    if data.last_plan_ms is not None:
        times.append(f"the last that planned took {data.last_plan_ms:.1f} ms")
    if data.last_idle_pass_ms is not None:
        times.append(f"the last with nothing to plan {data.last_idle_pass_ms:.2f} ms")
    return f" ({'; '.join(times)})" if times else ""


def print_deleted(data: admin.NodeDeleted, console: Console) -> None:
    line = f"node {shown(data.node)} deleted"
    if data.retired:
        line += f"; placed anew elsewhere: {', '.join(data.retired)}"
    console.print(line, highlight=False)


def print_node_revoked(data: admin.NodeRevoked, console: Console) -> None:
    line = f"node {shown(data.node)} revoked: nothing it sends is taken"
    if data.replacing:
        line += f"; its replicas are replaced elsewhere: {', '.join(data.replacing)}"
    console.print(line, highlight=False)


_JOIN_HEADINGS = ("ID", "STATE", "USED", "USES LEFT", "CREATED", "EXPIRES", "ALSO ADVERTISES")


def _join_row(t: admin.JoinTokenInfo) -> tuple[str, ...]:
    left = "any" if t.uses_left is None else str(t.uses_left)
    expires = "never" if t.expires_at is None else _when(t.expires_at)
    also = ", ".join(t.addresses) or "-"
    return (t.id, t.state, str(t.used), left, _when(t.created_at), expires, also)


def print_join_tokens(data: admin.JoinTokensAnswer, console: Console) -> None:
    if not data.tokens:
        console.print("no join tokens: make one with `modelfleet ctl join-tokens create`")
        return
    table = Table(*_JOIN_HEADINGS)
    for t in data.tokens:
        table.add_row(*_join_row(t))
    console.print(table)


def print_join_token_created(data: admin.JoinTokenCreated, console: Console) -> None:
    table = Table(*_JOIN_HEADINGS)
    table.add_row(*_join_row(data))
    console.print(table)
    console.print(f"token: {data.token}", highlight=False, soft_wrap=True)
    console.print(
        f"It pins the fleet's CA ({data.ca_fingerprint}) and is shown this once. On the new "
        "machine, with the token in a file only its owner may read (`chmod 600 FILE`): "
        "modelfleet agent --join AGENT_API_URL --token-file FILE --node NAME (or the token "
        "in MODELFLEET_AGENT_TOKEN); never on a command line, which any local user can read",
        highlight=False,
    )


def print_join_token_alone(data: admin.JoinTokenCreated, console: Console) -> None:
    console.print(data.token, highlight=False, soft_wrap=True)


def print_credentials(data: admin.CredentialsAnswer, console: Console) -> None:
    if not data.credentials:
        console.print("no node credentials: no node has joined with a join token")
        return
    table = Table("NODE", "REPORTED", "ADDRESSES", "TOKEN", "ISSUED")
    for c in data.credentials:
        addresses = "?" if c.addresses is None else ", ".join(c.addresses)
        reported = "yes" if c.reported else "never"
        table.add_row(c.node, reported, addresses, c.token_id, _when(c.issued_at))
    console.print(table)


def print_join_token_revoked(data: admin.JoinTokenInfo, console: Console) -> None:
    console.print(f"join token {data.id} revoked: no node joins with it now", highlight=False)


def print_nodes(data: admin.NodesAnswer, console: Console) -> None:
    table = Table(
        "NODE", "STATUS", "MARK", "REPLICAS", "GPUS USED", "MEMORY FREE", "LAST HEARD", "SHARDS"
    )
    for node in data.nodes:
        gpus = node.gpus
        used = sum(1 for g in gpus if g.in_use)
        healthy = sum(1 for g in gpus if g.healthy)
        status = "ready" if node.ready else "not ready"
        gpu_text = f"{used}/{len(gpus)}" + (
            f" ({len(gpus) - healthy} unhealthy)" if healthy < len(gpus) else ""
        )
        free = format_size(sum(g.memory_free for g in gpus if g.healthy and not g.in_use))
        mark: str = node.mark
        if mark == "draining":
            left = node.drain_grace_left_s
            done = node.replicas == 0
            mark += " (done)" if done else (f", {left:.0f}s of grace left" if left else "")
        table.add_row(
            shown(node.name),
            status,
            mark,
            str(node.replicas),
            gpu_text,
            free,
            f"{node.last_heard_s:.1f}s ago",
            str(node.shards),
        )
    console.print(table)
    detail = Table("NODE", "GPU", "MODEL", "MEMORY", "STATE")
    for node in data.nodes:
        for g in node.gpus:
            detail.add_row(
                shown(node.name),
                str(g.index),
                shown(g.model),
                format_size(g.memory_total),
                gpu_state(g),
            )
    console.print(detail)
    if data.warning:
        console.print(f"warning: {shown(data.warning)}", highlight=False)


def print_scaling(scaling: list[admin.ScaleInfo], console: Console) -> None:
    """The models that follow their load: count, bounds, target, load, and why."""
    if not scaling:
        return
    table = Table("AUTOSCALED", "REPLICAS", "MIN..MAX", "TARGET", "LOAD", "WHY (SINCE)")
    for s in scaling:
        since = f" ({_when(s.since)})" if s.since is not None else ""
        why = escape(s.reason) + since
        if s.now and not s.now.startswith("steady"):
            why += f"; now: {escape(s.now)}"
        load = "-" if s.load is None else f"{s.load:g}"
        table.add_row(
            escape(s.model),
            str(s.replicas),
            f"{s.min}..{s.max}",
            f"{s.target_in_flight:g}/replica",
            load,
            why,
        )
    console.print(table)


def print_replicas(data: admin.ReplicasAnswer, console: Console) -> None:
    table = Table("REPLICA", "MODEL", "STATE", "SHARDS (node[gpus]: state)", "ENDPOINT", "ERROR")
    for r in data.replicas:
        shards = ", ".join(f"{shown(s.node)}{s.gpus}: {s.state}" for s in r.shards)
        error = shown(r.error) or "; ".join(shown(s.error) for s in r.shards if s.error)
        if r.ejected:
            out = f"out of rotation at {len(r.ejected)} router(s)"
            error = f"{error}; {out}" if error else out
        state = f"[yellow]{r.state}[/]" if r.state == "out-of-rotation" else r.state
        table.add_row(r.id, r.model, state, shards, r.endpoint or "-", error or "-")
    for p in data.pending:
        table.add_row("-", p.model, f"pending x{p.count}", "-", "-", p.reason)
    console.print(table)
    print_scaling(data.scaling, console)


def print_explanation(data: admin.Explanation, console: Console) -> None:
    console.print(f"model {data.model}: each shard needs {data.needs}")
    if data.pending:
        console.print(f"{data.pending} replica(s) pending: {data.pending_reason}")
    console.print(f"next replica: {data.summary}")
    table = Table("NODE", "FITS", "USABLE GPUS", "WHY NOT")
    for v in data.nodes:
        fits = "yes" if not v.reasons else "no"
        usable = ",".join(str(g) for g in v.usable_gpus) or "-"
        table.add_row(shown(v.node), fits, usable, "\n".join(map(shown, v.reasons)) or "-")
    console.print(table)


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def print_catalog(data: admin.CatalogAnswer, console: Console) -> None:
    console.print(
        f"catalog version {data.version}  digest {data.digest}  "
        f"applied {_when(data.applied_at)} from {escape(data.source)}"
    )
    table = Table("MODEL", "ENGINE", "REPLICAS", "SHARDS x GPUS", "GPU MEMORY", "ARGS")
    for m in data.models:
        table.add_row(
            m.name,
            m.engine,
            str(m.replicas)
            if m.autoscale is None
            else f"{m.autoscale.min}-{m.autoscale.max}, by load",
            f"{m.shards} x {m.gpus_per_shard}",
            format_size(m.gpu_memory) if m.gpu_memory else "-",
            escape(" ".join(m.args)) or "-",
        )
    console.print(table)
    rejected = data.last_rejection
    if rejected:
        console.print(
            f"last rejected attempt: {_when(rejected.at)} from {escape(rejected.source)}, "
            f"{len(rejected.problems)} problem(s):"
        )
        for problem in rejected.problems:
            console.print(f"  - {escape(problem)}", highlight=False)


def catalog_yaml(data: admin.CatalogAnswer) -> str:
    """The catalog as a catalog file: what `ctl catalog apply` takes back as the same
    catalog."""
    from modelfleet.core.catalog import Catalog

    models = [m.model_dump(mode="json", exclude_none=True) for m in data.models]
    header = f"# catalog version {data.version}, digest {data.digest}\n"
    return header + Catalog.new(models).to_yaml()


def print_catalog_history(data: admin.CatalogHistory, console: Console) -> None:
    table = Table("VERSION", "APPLIED", "DIGEST", "SOURCE", "MODELS")
    for v in data.versions:
        table.add_row(
            str(v.version),
            _when(v.applied_at),
            v.digest,
            escape(v.source),
            ", ".join(v.models) or "-",
        )
    console.print(table)


def _where(step: admin.Step) -> str:
    return ", ".join(f"{shown(s.node)}{s.gpus}" for s in step.shards)


def print_catalog_plan(data: admin.CatalogChange, console: Console) -> None:
    if data.dry_run:
        head = "dry run, nothing changed: " + (
            "this catalog differs from the current one"
            if data.changed
            else "this catalog is the current one"
        )
        console.print(f"{head} (version {data.version})")
    elif data.changed:
        console.print(f"applied: catalog version {data.version} (was {data.previous_version})")
    else:
        console.print(f"unchanged: the catalog is already version {data.version}")
    print_steps(data.steps, data.pending, console)
    if data.adapters:
        table = Table("REPLICA", "LOADS", "UNLOADS")
        for change in data.adapters:
            table.add_row(change.replica, ", ".join(change.load) or "-",
                          ", ".join(change.unload) or "-")  # fmt: skip
        console.print(table)
        console.print("adapters are loaded into running engines: nothing restarts", style="dim")


def print_mark(data: admin.MarkAnswer, console: Console) -> None:
    if data.dry_run:
        line = f"node {shown(data.node)} would be {data.mark} (it is {data.was}); nothing was "
        line += "marked"
    else:
        line = f"node {shown(data.node)}: {data.mark} (was {data.was})"
    if data.drain_grace_s:
        line += f"; what does not move within {data.drain_grace_s:.0f}s is stopped anyway"
    console.print(line)
    print_steps(data.steps, data.pending, console)
    if data.cannot_move:
        one = len(data.cannot_move) == 1
        if data.drain_grace_s:
            after = (
                f"{'it stops' if one else 'they stop'} after {data.drain_grace_s:.0f}s anyway, "
                f"and {'its model serves' if one else 'their models serve'} with fewer"
            )
        else:
            after = f"{'it stays' if one else 'they stay'} until room is found (no bound)"
        console.print(
            f"not every replica can move: {', '.join(data.cannot_move)} cannot be replaced "
            f"(why above); {after}",
            style="yellow",
            highlight=False,
        )


def print_steps(
    steps: list[admin.Step], pending: list[admin.PendingStep], console: Console
) -> None:
    """The replicas a change starts and stops, step by step (a preview from the admin API)."""
    if not (steps or pending):
        console.print("no replica starts or stops")
        return
    table = Table("STEP", "ACTION", "REPLICA", "MODEL", "WHERE", "WHY")
    for s in steps:
        rid = "(new)" if s.action == "start" else s.id
        table.add_row(str(s.step), s.action, rid, s.model, _where(s), s.reason or "-")
    for p in pending:
        table.add_row("-", f"pending x{p.count}", "-", p.model, "-", p.reason)
    console.print(table)
    console.print(
        "steps run in order: the next step follows once the replicas a step started serve",
        style="dim",
    )


def print_replica(data: admin.ReplicaInfo, console: Console) -> None:
    """One replica in full: a line for it, a table of its shards, then each failed shard's
    error and the tail of its engine's log."""
    head = f"replica {data.id}  model {data.model}  state {data.state}"
    if data.endpoint:
        head += f"  endpoint {data.endpoint}"
    console.print(head, highlight=False)
    if data.reason:
        console.print(f"retiring: {escape(data.reason)}", highlight=False)
    for why in data.ejected:
        console.print(f"out of rotation: {escape(why)}", style="yellow", highlight=False)
    if data.generation:
        console.print(
            f"its shards were restarted together {data.generation} time(s) "
            f"({data.group_restarts} since it last served); the last because "
            f"{escape(data.last_failure)}",
            highlight=False,
        )
    table = Table(
        "SHARD",
        "NODE",
        "GPUS",
        "STATE",
        "PID",
        "PORT",
        "RESTARTS",
        "FAILURES",
        "STARTED IN",
        "NEXT START",
        "ENGINE KEY",
    )
    for s in data.shards:
        nxt = f"after {s.backoff_s:.0f}s backoff" if s.backoff_s is not None else "-"
        started = f"{s.startup_s:.1f}s" if s.startup_s is not None else "-"
        table.add_row(
            str(s.rank),
            shown(s.node),
            ",".join(str(g) for g in s.gpus),
            s.state,
            str(s.pid or "-"),
            str(s.port or "-"),
            str(s.restarts),
            str(s.failures),
            started,
            nxt,
            "set" if s.engine_key_set else "-",
        )
    console.print(table)
    adapters = [a for s in data.shards for a in s.adapters]
    if adapters:
        held = Table("ADAPTER", "STATE", "TRIES", "ENGINE SAID")
        for a in adapters:
            held.add_row(a.name, a.state, str(a.tries), escape(a.error) or "-")
        console.print(held)
    for s in data.shards:
        if s.error:
            console.print(f"shard {s.rank} error: {escape(s.error)}", highlight=False)
        if s.log_tail:
            console.print(f"shard {s.rank} log, last {len(s.log_tail)} line(s):")
            for line in s.log_tail:
                console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _key_row(k: admin.KeyInfo) -> list[str]:
    return [
        k.name,
        k.prefix + "...",
        ", ".join(k.models) if k.models is not None else "all",
        _limit(k.rpm),
        _limit(k.tpm),
        _limit(k.max_concurrent),
        _when(k.created_at),
        _when(k.expires_at) if k.expires_at is not None else "never",
        str(k.requests),
        str(k.tokens),
        _when(k.last_used_at) if k.last_used_at is not None else "never",
    ]


_KEY_HEADINGS = (
    "NAME", "KEY", "MODELS", "RPM", "TPM", "CONCURRENT", "CREATED", "EXPIRES",
    "REQUESTS", "TOKENS", "LAST USED",
)  # fmt: skip


def print_keys(data: admin.KeysAnswer, console: Console) -> None:
    if not data.keys:
        console.print("no keys: make one with `modelfleet ctl keys create NAME`")
        return
    table = Table(*_KEY_HEADINGS)
    for k in data.keys:
        table.add_row(*(escape(cell) for cell in _key_row(k)))
    console.print(table)


def print_key(data: admin.KeyInfo, console: Console) -> None:
    table = Table(*_KEY_HEADINGS)
    table.add_row(*(escape(cell) for cell in _key_row(data)))
    console.print(table)


def print_key_created(data: admin.KeyCreated, console: Console) -> None:
    print_key(data, console)
    console.print(f"key: {data.key}", highlight=False, soft_wrap=True)
    console.print("It is shown this once: the fleet keeps only its hash.", highlight=False)


def print_key_alone(data: admin.KeyCreated, console: Console) -> None:
    console.print(data.key, highlight=False, soft_wrap=True)


def print_revoked(data: admin.KeyInfo, console: Console) -> None:
    console.print(
        f"key {data.name} ({data.prefix}...) revoked; every router refuses it from its next "
        "routing table",
        highlight=False,
    )


_USAGE_FIELDS = ("hour", "key", "model", "requests", "prompt_tokens", "completion_tokens",
                 "errors")  # fmt: skip


def print_usage(data: admin.UsageAnswer, console: Console) -> None:
    if not data.usage:
        console.print(f"no usage since {_when(data.since)}", highlight=False)
        return
    table = Table("HOUR", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "ERRORS")
    for u in data.usage:
        table.add_row(
            _when(u.hour), escape(u.key), escape(u.model), str(u.requests),
            str(u.prompt_tokens), str(u.completion_tokens), str(u.errors),
        )  # fmt: skip
    console.print(table)


def usage_csv(data: admin.UsageAnswer) -> str:
    """The usage as CSV, the hour in ISO 8601 (UTC), for spreadsheets and scripts."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_USAGE_FIELDS)
    for u in data.usage:
        hour = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(u.hour))
        writer.writerow([hour, u.key, u.model, u.requests, u.prompt_tokens,
                         u.completion_tokens, u.errors])  # fmt: skip
    return out.getvalue()


def print_rebalance(data: admin.RebalanceAnswer, console: Console) -> None:
    if not data.moves:
        console.print("nothing to move: every spread model is as even as its nodes allow")
        return
    verb = "would move" if data.dry_run else "moving"
    for m in data.moves:
        console.print(
            f"{verb} {m.replica} ({m.model}) from {shown(m.from_node)} to {shown(m.to_node)}: "
            f"{shown(m.reason)}",
            highlight=False,
        )
    if not data.dry_run:
        console.print(
            "each is replaced first and leaves the routers once its replacement serves; "
            "`modelfleet ctl replicas` follows it"
        )


def print_events(data: admin.EventsAnswer, console: Console) -> None:
    if not data.events:
        console.print("no events in that time", highlight=False)
        return
    table = Table("LAST SEEN", "TYPE", "REASON", "OBJECT", "COUNT", "MESSAGE")
    for e in data.events:
        table.add_row(
            _when(e.last_at), e.type, e.reason, escape(e.regarding), str(e.count),
            escape(e.message),
        )  # fmt: skip
    console.print(table)


def event_line(e: admin.EventInfo) -> str:
    """One event as a line, for `ctl events --watch`."""
    repeat = f" (x{e.count})" if e.count > 1 else ""
    return f"{_when(e.last_at)}  {e.type:<7}  {e.reason:<16}  {e.regarding}  {e.message}{repeat}"
