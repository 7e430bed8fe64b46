"""`modelfleet ctl`: the operator's CLI. It talks only to the control plane's admin API.

Where to find the admin API, in order: `--admin URL --token T`, then the variables
`MODELFLEET_ADMIN_URL` / `MODELFLEET_ADMIN_TOKEN`, then `<state-dir>/up.json` written by
`modelfleet up`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelfleet.units import format_size


class CtlError(Exception):
    """A failure ctl reports as one line and a non-zero exit."""


@dataclass(frozen=True)
class AdminTarget:
    url: str
    token: str


def resolve_target(admin: str | None, token: str | None, state_dir: Path) -> AdminTarget:
    """Find the admin API from flags, environment, or the state dir's up.json."""
    admin = admin or os.environ.get("MODELFLEET_ADMIN_URL")
    token = token or os.environ.get("MODELFLEET_ADMIN_TOKEN")
    if admin is None or token is None:
        up_file = state_dir / "up.json"
        try:
            up = json.loads(up_file.read_text())
        except FileNotFoundError:
            raise CtlError(
                f"no admin API given and no {up_file} (is `modelfleet up` running?); "
                "pass --admin URL --token T or set MODELFLEET_ADMIN_URL / MODELFLEET_ADMIN_TOKEN"
            ) from None
        except (OSError, ValueError) as exc:
            raise CtlError(f"cannot read {up_file}: {exc}") from exc
        admin = admin or up.get("admin_url")
        token = token or up.get("admin_token")
        if not admin or not token:
            raise CtlError(f"{up_file} has no admin_url / admin_token")
    return AdminTarget(admin.rstrip("/"), token)


class CatalogRefused(CtlError):
    """The admin API refused a catalog; `problems` lists every problem it found."""

    def __init__(self, message: str, problems: list[dict[str, str]]) -> None:
        super().__init__(message)
        self.problems = problems


def request(
    target: AdminTarget, method: str, path: str, content: bytes | None = None
) -> dict[str, Any]:
    """Call the admin API; every failure becomes a one-line CtlError (CatalogRefused on 422)."""
    try:
        response = httpx.request(
            method,
            target.url + path,
            content=content,
            headers={"authorization": f"Bearer {target.token}"},
            timeout=10,
        )
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot reach the admin API at {target.url}: {exc}") from exc
    if response.status_code == 401:
        raise CtlError(f"the admin API at {target.url} refused the token (401)")
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code == 422 and isinstance(data, dict) and "problems" in data:
        raise CatalogRefused(str(data.get("error", "refused")), list(data["problems"]))
    if response.status_code != 200:
        detail = data.get("error") if isinstance(data, dict) else response.text[:200]
        raise CtlError(f"{target.url}{path} answered {response.status_code}: {detail}")
    if not isinstance(data, dict):
        raise CtlError(f"{target.url}{path} answered something that is not a JSON object")
    return data


def get(target: AdminTarget, path: str) -> dict[str, Any]:
    """GET an admin API path; every failure becomes a one-line CtlError."""
    return request(target, "GET", path)


def gpu_cell(gpu: dict[str, Any]) -> str:
    if not gpu["healthy"]:
        return f"{gpu['index']}:unhealthy ({gpu['reason'] or 'no reason given'})"
    return f"{gpu['index']}:{'used' if gpu['in_use'] else 'free'}"


def print_nodes(data: dict[str, Any], console: Console) -> None:
    table = Table(
        "NODE", "STATUS", "MARK", "REPLICAS", "GPUS USED", "MEMORY FREE", "LAST REPORT", "SHARDS"
    )
    for node in data["nodes"]:
        gpus = node["gpus"]
        used = sum(1 for g in gpus if g["in_use"])
        healthy = sum(1 for g in gpus if g["healthy"])
        status = "ready" if node["ready"] else "not ready"
        gpu_text = f"{used}/{len(gpus)}" + (
            f" ({len(gpus) - healthy} unhealthy)" if healthy < len(gpus) else ""
        )
        free = format_size(sum(g["memory_free"] for g in gpus if g["healthy"] and not g["in_use"]))
        mark = node["mark"]
        if mark == "draining":
            left = node.get("drain_grace_left_s")
            done = node.get("replicas", 0) == 0
            mark += " (done)" if done else (f", {left:.0f}s of grace left" if left else "")
        table.add_row(
            node["name"],
            status,
            mark,
            str(node.get("replicas", "-")),
            gpu_text,
            free,
            f"{node['last_report_s']:.1f}s ago",
            str(node["shards"]),
        )
    console.print(table)
    detail = Table("NODE", "GPU", "MODEL", "MEMORY", "STATE")
    for node in data["nodes"]:
        for g in node["gpus"]:
            state = gpu_cell(g).split(":", 1)[1]
            detail.add_row(
                node["name"], str(g["index"]), g["model"], format_size(g["memory_total"]), state
            )
    console.print(detail)


def print_replicas(data: dict[str, Any], console: Console) -> None:
    table = Table("REPLICA", "MODEL", "STATE", "SHARDS (node[gpus]: state)", "ENDPOINT", "ERROR")
    for r in data["replicas"]:
        shards = ", ".join(f"{s['node']}{list(s['gpus'])}: {s['state']}" for s in r["shards"])
        error = "; ".join(s["error"] for s in r["shards"] if s["error"])
        table.add_row(r["id"], r["model"], r["state"], shards, r["endpoint"] or "-", error or "-")
    for p in data["pending"]:
        table.add_row("-", p["model"], f"pending x{p['count']}", "-", "-", p["reason"])
    console.print(table)


def print_explanation(data: dict[str, Any], console: Console) -> None:
    console.print(f"model {data['model']}: each shard needs {data['needs']}")
    if data["pending"]:
        console.print(f"{data['pending']} replica(s) pending: {data['pending_reason']}")
    console.print(f"next replica: {data['summary']}")
    table = Table("NODE", "FITS", "USABLE GPUS", "WHY NOT")
    for v in data["nodes"]:
        fits = "yes" if not v["reasons"] else "no"
        usable = ",".join(str(g) for g in v["usable_gpus"]) or "-"
        table.add_row(v["node"], fits, usable, "\n".join(v["reasons"]) or "-")
    console.print(table)


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def print_catalog(data: dict[str, Any], console: Console) -> None:
    console.print(
        f"catalog version {data['version']}  digest {data['digest']}  "
        f"applied {_when(data['applied_at'])} from {escape(data['source'])}"
    )
    table = Table("MODEL", "ENGINE", "REPLICAS", "SHARDS x GPUS", "GPU MEMORY", "ARGS")
    for m in data["models"]:
        table.add_row(
            m["name"],
            m["engine"],
            str(m["replicas"]),
            f"{m['shards']} x {m['gpus_per_shard']}",
            format_size(m["gpu_memory"]) if m["gpu_memory"] else "-",
            escape(" ".join(m["args"])) or "-",
        )
    console.print(table)
    rejected = data.get("last_rejection")
    if rejected:
        console.print(
            f"last rejected attempt: {_when(rejected['at'])} from {escape(rejected['source'])}, "
            f"{len(rejected['problems'])} problem(s):"
        )
        for problem in rejected["problems"]:
            console.print(f"  - {escape(problem)}", highlight=False)


def print_catalog_history(data: dict[str, Any], console: Console) -> None:
    table = Table("VERSION", "APPLIED", "DIGEST", "SOURCE", "MODELS")
    for v in data["versions"]:
        table.add_row(
            str(v["version"]),
            _when(v["applied_at"]),
            v["digest"],
            escape(v["source"]),
            ", ".join(v["models"]) or "-",
        )
    console.print(table)


def _where(replica: dict[str, Any]) -> str:
    return ", ".join(f"{s['node']}{s['gpus']}" for s in replica["shards"])


def print_catalog_plan(data: dict[str, Any], console: Console) -> None:
    if data["dry_run"]:
        head = "dry run, nothing changed: " + (
            "this catalog differs from the current one"
            if data["changed"]
            else "this catalog is the current one"
        )
        console.print(f"{head} (version {data['version']})")
    elif data["changed"]:
        was = data["previous_version"]
        console.print(f"applied: catalog version {data['version']} (was {was})")
    else:
        console.print(f"unchanged: the catalog is already version {data['version']}")
    print_steps(data, console)


def print_mark(data: dict[str, Any], console: Console) -> None:
    line = f"node {data['node']}: {data['mark']} (was {data['was']})"
    if data.get("drain_grace_s"):
        line += f"; what does not move within {data['drain_grace_s']:.0f}s is stopped anyway"
    console.print(line)
    print_steps(data, console)


def print_steps(data: dict[str, Any], console: Console) -> None:
    """The replicas a change starts and stops, step by step (a preview from the admin API)."""
    if not (data["steps"] or data["pending"]):
        console.print("no replica starts or stops")
        return
    table = Table("STEP", "ACTION", "REPLICA", "MODEL", "WHERE", "WHY")
    for s in data["steps"]:
        rid = "(new)" if s["action"] == "start" else s["id"]
        table.add_row(str(s["step"]), s["action"], rid, s["model"], _where(s), s["reason"] or "-")
    for p in data["pending"]:
        table.add_row("-", f"pending x{p['count']}", "-", p["model"], "-", p["reason"])
    console.print(table)
    console.print(
        "steps run in order: the next step follows once the replicas a step started serve",
        style="dim",
    )


def print_replica(data: dict[str, Any], console: Console) -> None:
    """One replica in full: a line for it, a table of its shards, then each failed shard's
    error and the tail of its engine's log."""
    head = f"replica {data['id']}  model {data['model']}  state {data['state']}"
    if data["endpoint"]:
        head += f"  endpoint {data['endpoint']}"
    console.print(head, highlight=False)
    if data.get("reason"):
        console.print(f"retiring: {escape(data['reason'])}", highlight=False)
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
    )
    for s in data["shards"]:
        nxt = f"after {s['backoff_s']:.0f}s backoff" if s.get("backoff_s") is not None else "-"
        started = f"{s['startup_s']:.1f}s" if s.get("startup_s") is not None else "-"
        table.add_row(
            str(s["rank"]),
            s["node"],
            ",".join(str(g) for g in s["gpus"]),
            s["state"],
            str(s["pid"] or "-"),
            str(s["port"] or "-"),
            str(s["restarts"]),
            str(s.get("failures", 0)),
            started,
            nxt,
        )
    console.print(table)
    for s in data["shards"]:
        if s["error"]:
            console.print(f"shard {s['rank']} error: {escape(s['error'])}", highlight=False)
        if s["log_tail"]:
            console.print(f"shard {s['rank']} log, last {len(s['log_tail'])} line(s):")
            for line in s["log_tail"]:
                console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
