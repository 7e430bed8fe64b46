"""`modelfleet ctl`: the operator's CLI. It talks only to the control plane's admin API.

Where to find the admin API, in order: `--admin URL --token T`, then the variables
`MODELFLEET_ADMIN_URL` / `MODELFLEET_ADMIN_TOKEN`, then `<state-dir>/up.json` written by
`modelfleet up`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
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


def get(target: AdminTarget, path: str) -> dict[str, Any]:
    """GET an admin API path; every failure becomes a one-line CtlError."""
    try:
        response = httpx.get(
            target.url + path,
            headers={"authorization": f"Bearer {target.token}"},
            timeout=10,
        )
    except httpx.HTTPError as exc:
        raise CtlError(f"cannot reach the admin API at {target.url}: {exc}") from exc
    if response.status_code == 401:
        raise CtlError(f"the admin API at {target.url} refused the token (401)")
    if response.status_code != 200:
        raise CtlError(f"{target.url}{path} answered {response.status_code}: {response.text[:200]}")
    try:
        return response.json()
    except ValueError as exc:
        raise CtlError(f"{target.url}{path} answered something that is not JSON") from exc


def gpu_cell(gpu: dict[str, Any]) -> str:
    if not gpu["healthy"]:
        return f"{gpu['index']}:unhealthy ({gpu['reason'] or 'no reason given'})"
    return f"{gpu['index']}:{'used' if gpu['in_use'] else 'free'}"


def print_nodes(data: dict[str, Any], console: Console) -> None:
    table = Table("NODE", "STATUS", "MARK", "GPUS USED", "MEMORY FREE", "LAST REPORT", "SHARDS")
    for node in data["nodes"]:
        gpus = node["gpus"]
        used = sum(1 for g in gpus if g["in_use"])
        healthy = sum(1 for g in gpus if g["healthy"])
        status = "ready" if node["ready"] else "not ready"
        gpu_text = f"{used}/{len(gpus)}" + (
            f" ({len(gpus) - healthy} unhealthy)" if healthy < len(gpus) else ""
        )
        free = format_size(sum(g["memory_free"] for g in gpus if g["healthy"] and not g["in_use"]))
        table.add_row(
            node["name"],
            status,
            node["mark"],
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
