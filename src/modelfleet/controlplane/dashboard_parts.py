"""What each live part of the dashboard shows (`dashboard.py` streams them): the fleet as the
control plane knows it, and what the store holds (events, usage, plots), rendered from the
templates, and rendered again only when what a part is made from changed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import jinja2
from markupsafe import Markup, escape

from modelfleet.controlplane import views
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.series import RANGES, Shown, shown, shown_width, source_step
from modelfleet.messages import admin
from modelfleet.store import StoredEvent, StoredPoint, StoredUsage, StoreError

EVENTS_SHOWN = 200
HEARD_NOW_S = 5.0  # a node heard from this recently shows as heard "now"
# The series each plotted page shows (`controlplane/series.py`), by its part.
PLOTS = {"model": "model", "node": "node", "usage": "key"}
DEFAULT_RANGE = "1h"
# A plot's points are read from the store again when the recorder wrote new ones, and at
# least this often (another control plane may write them: this one follows).
PLOT_READ_EVERY_S = 5.0
_PERCENTILE = re.compile(r".+_p\d+")  # a plotted value that is a time: shown in ms


@dataclass(frozen=True)
class Plotted:
    """What plots of one range show, as read from the store: each subject's points."""

    span: str  # a name of RANGES
    lines: dict[str, list[Shown]]
    width: int  # the seconds each shown point covers
    version: int  # one more at each reading: a part re-renders when it moves on
    written: int  # the recorder's writes when read
    read_at: float  # the control plane's monotonic clock when read


@dataclass(frozen=True)
class Stored:
    """What a live part shows of the store, read for one rendering."""

    events: list[StoredEvent] = field(default_factory=list)
    usage: list[StoredUsage] = field(default_factory=list)
    totals: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    plotted: Plotted | None = None
    problem: str | None = None  # why the store could not be read


class LiveParts:
    """The live parts of one control plane's dashboard, rendered with `env`."""

    def __init__(self, cp: ControlPlane, env: jinja2.Environment) -> None:
        self.cp = cp
        self.env = env
        # (part, name, range) -> (basis, html)
        self._rendered: dict[tuple[str, str, str], tuple[Any, str]] = {}
        self._plotted: dict[tuple[str, str | None, str], Plotted] = {}

    async def stored(self, part: str, name: str, span: str = DEFAULT_RANGE) -> Stored:
        """What a part shows of the store (events, usage, plots), read off the event loop;
        during a store outage, nothing, with why."""
        cp, store = self.cp, self.cp.store
        try:
            plotted = await self._plots(PLOTS[part], name or None, span) if part in PLOTS else None
            if part == "model" and plotted is not None:
                return Stored(plotted=plotted)
            if part == "events":
                regarding, kind = _read_filter(name)
                found = await cp.calls(cp.read_events, regarding, 0.0, 0, EVENTS_SHOWN)
                return Stored(events=[e for e in found if kind is None or e.type == kind])
            if part == "node":
                events = await cp.calls(cp.read_events, f"node/{name}", 0.0, 0, 50)
                return Stored(events=events, plotted=plotted)
            if part == "usage":
                since = int((cp.clock.time() - 24 * 3600) // 3600) * 3600
                usage = await cp.calls(store.usage, None, None, since)
                totals = await cp.calls(store.usage_totals)
                return Stored(usage=usage, totals=totals, plotted=plotted)
        except StoreError as exc:
            return Stored(problem=str(exc))
        return Stored()

    async def _plots(self, kind: str, subject: str | None, span: str) -> Plotted:
        """The points of `kind` (of one subject, or of each) over `span`, as plotted: read
        from the store when the recorder wrote since, or PLOT_READ_EVERY_S passed."""
        cp = self.cp
        key = (kind, subject, span)
        now = cp.clock.monotonic()
        held = self._plotted.get(key)
        if (
            held is not None
            and held.written == cp.recorder.written
            and now - held.read_at < PLOT_READ_EVERY_S
        ):
            return held
        seconds = RANGES[span]
        step = source_step(seconds, cp.recorder.step)
        wall = cp.clock.time()
        points = await cp.calls(cp.store.points, kind, subject, step, wall - seconds - step)
        by_subject: dict[str, list[StoredPoint]] = {}
        for p in points:
            by_subject.setdefault(p.subject, []).append(p)
        lines = {s: shown(kind, got, seconds, wall) for s, got in sorted(by_subject.items())}
        made = Plotted(
            span=span,
            lines=lines,
            width=shown_width(seconds, step),
            version=(held.version + 1) if held is not None else 1,
            written=cp.recorder.written,
            read_at=now,
        )
        # Forget what nobody looked at for a while (a page per node of a large fleet).
        self._plotted = {k: v for k, v in self._plotted.items() if now - v.read_at < 60.0}
        self._plotted[key] = made
        return made

    def part(self, part: str, name: str, stored: Stored) -> dict[str, Any] | None:
        """What a page's live part shows now; None for a node or model there is not."""
        cp = self.cp
        if part == "overview":
            return self._overview()
        if part == "node":
            return self._node(name, stored)
        if part == "model":
            return self._model(name, stored)
        if part == "replica":
            return self._replica(name)
        if part == "pending":
            return {"pending": views.replicas(cp.state, cp.catalogs.current).pending}
        if part == "events":
            regarding, kind = _read_filter(name)
            shown = {"for": regarding or "", "type": kind or ""}
            return {"events": list(reversed(stored.events)), "filter": shown}
        if part == "usage":
            return self._usage(stored)
        return None

    async def render_part(self, part: str, name: str, span: str = DEFAULT_RANGE) -> str | None:
        """The live part rendered now, or as rendered last when nothing it shows has changed
        since (shared by every stream of it: viewers do not multiply the work)."""
        key = (part, name, span)
        stored = await self.stored(part, name, span)
        basis = self._basis(part, name, stored)
        held = self._rendered.get(key)
        if held is not None and basis is not None and held[0] == basis:
            return held[1]
        context = self.part(part, name, stored)
        if context is None:
            return None
        if part in PLOTS:
            plots = {"span": span, "ranges": list(RANGES), "plotted": stored.plotted}
            context = {**context, **plots, "problem": stored.problem}
        html = self.env.get_template(f"_{part}.html").render(**context, name=name)
        self._rendered[key] = (basis, html)
        return html

    def _basis(self, part: str, name: str, stored: Stored) -> tuple[Any, ...] | None:
        """What a part is made from, in short: while it stays the same, so does the part.
        None: the part is made anew each time (events and usage, which are read from the
        store, cheaply)."""
        cp = self.cp
        if part not in ("overview", "node", "model", "replica", "pending"):
            return None
        state = cp.state
        now = cp.clock.monotonic()
        nodes = state.node_list()
        ejected = cp.loads.ejections(now)
        basis: tuple[Any, ...] = (
            state.changes.version,
            cp.catalogs.current.version,
            cp.frozen,
            state.pending,
            # Every page shows a replica out of rotation as such (not "ready"): which are out
            # is part of what each is made from.
            tuple(sorted(ejected)),
            tuple(n.name for n in nodes if not n.is_ready(now, state.stale_after)),
            # What the pages show of time: a node's whole seconds since it was heard, past
            # HEARD_NOW_S ("now" before).
            tuple(
                (n.name, int(now - n.last_report))
                for n in nodes
                if n.last_report is not None and now - n.last_report >= HEARD_NOW_S
            ),
        )
        if part == "node":
            last = stored.events[-1] if stored.events else None  # the last seen: a repeat too
            basis += ((last.id, last.count) if last else None, stored.problem)
        if stored.plotted is not None:
            basis += (stored.plotted.version, stored.problem)
        if part == "replica":
            basis += (tuple(ejected.get(name, ())), *self._load(name).values())
        return basis

    # -- what each part shows -----------------------------------------------------------

    def _overview(self) -> dict[str, Any]:
        cp = self.cp
        now = cp.clock.monotonic()
        nodes = views.nodes(cp.state, now, cp.frozen)
        return {
            "nodes": nodes.nodes,
            "grids": {n.name: _gpu_grid(n.gpus) for n in nodes.nodes},
            "warning": nodes.warning,
            "models": _model_rows(cp),
            "gpus": [g for n in nodes.nodes for g in n.gpus],
            "pending": sum(p.count for p in cp.state.pending),
        }

    def _node(self, name: str, stored: Stored) -> dict[str, Any] | None:
        cp = self.cp
        now = cp.clock.monotonic()
        node = next((n for n in views.nodes(cp.state, now).nodes if n.name == name), None)
        if node is None:
            return None
        ejections = cp.loads.ejections(cp.clock.monotonic())
        replicas = views.replica_views(cp.state, ejections)
        here = [r for r in replicas if any(s.node == name for s in r.shards)]
        moving = ", ".join(f"{r.id} ({r.model})" for r in here) or "none"
        return {
            "node": node,
            "replicas": here,
            "events": list(reversed(stored.events)),
            "plot": _plot_json(stored.plotted.lines.get(name, []) if stored.plotted else []),
            "confirm": {
                "cordoned": f"Cordon {name}? New replicas go elsewhere; its {len(here)} "
                "replica(s) stay and serve.",
                "draining": f"Drain {name}? Each of its replicas is replaced elsewhere before "
                f"it stops, where there is room ({moving}); one whose replacement cannot be "
                "placed stops when the drain's grace period is over (`ctl drain "
                f"{name} --dry-run` says which).",
                "none": f"Uncordon {name}? New replicas may be placed on it again.",
            },
        }

    def _model(self, name: str, stored: Stored) -> dict[str, Any] | None:
        cp = self.cp
        catalog = cp.catalogs.current
        model = next((m for m in catalog.models if m.name == name), None)
        if model is None:
            return None
        ejections = cp.loads.ejections(cp.clock.monotonic())
        replicas = [r for r in views.replica_views(cp.state, ejections) if r.model == name]
        points = stored.plotted.lines.get(name, []) if stored.plotted else []
        pending = [p for p in views.replicas(cp.state, catalog).pending if p.model == name]
        scaling = next((x for x in views.scaling(cp.autoscaler, catalog) if x.model == name), None)
        return {
            "model": model,
            "replicas": replicas,
            "pending": pending,
            "scaling": scaling,
            "plot": _plot_json(points),
        }

    def _replica(self, rid: str) -> dict[str, Any] | None:
        """A replica in full: its state, each shard's (restarts, failures in a row, start
        time, error, the end of its log), why routers send it nothing, and its load."""
        cp = self.cp
        record = cp.state.replicas.get(rid)
        if record is None:
            return None
        ejected = cp.loads.ejections(cp.clock.monotonic()).get(rid, [])
        return {"replica": views.replica_view(cp.state, record, ejected), **self._load(rid)}

    def _load(self, rid: str) -> dict[str, Any]:
        """A replica's load as the routers report it: requests here, at its engine, and its
        KV cache in use (None for what no router has said)."""
        record = self.cp.state.replicas.get(rid)
        loads = self.cp.loads.loads(self.cp.clock.monotonic()) or {}
        model = loads.get(record.replica.model) if record is not None else None
        return {
            "load": model.replicas.get(rid) if model else None,
            "at_engine": model.engines.get(rid) if model else None,
            "cache": model.cache.get(rid) if model else None,
        }

    def _usage(self, stored: Stored) -> dict[str, Any]:
        cp = self.cp
        used = stored.totals
        keys = [(name, k, used.get(name)) for name, k in sorted(cp.keys.keys.items())]
        lines = stored.plotted.lines if stored.plotted else {}
        at = sorted({p.at for points in lines.values() for p in points})
        plot: dict[str, Any] = {"at": at}
        for measure in ("requests_per_s", "tokens_per_s", "limited_per_s"):
            per_key = plot[measure] = {}
            for key, points in lines.items():
                by_at = {p.at: p.values.get(measure) for p in points}
                per_key[key] = [_round(by_at.get(t)) for t in at]
        # The catalog's adapters, each to its base: usage counts an adapter as a model.
        parents = {a.name: m.name for m in cp.catalogs.current.models for a in m.adapters}
        return {
            "rows": stored.usage,
            "keys": keys,
            "plot": json.dumps(plot),
            "parents": parents,
            "per_worker": cp.loads.limits_per_worker(),
        }


def _model_rows(cp: ControlPlane) -> list[dict[str, Any]]:
    by_state: dict[str, dict[str, int]] = {}
    ejections = cp.loads.ejections(cp.clock.monotonic())
    for record in cp.state.replicas.values():
        counts = by_state.setdefault(record.replica.model, {})
        shown = views.replica_state(cp.state, record, ejections.get(record.replica.id, ()))
        counts[shown] = counts.get(shown, 0) + 1
    pending = {p.model: p.count for p in cp.state.pending}
    catalog = cp.catalogs.current
    scaled = cp.autoscaler.wanted(catalog)  # a model that follows its load: its count now
    return [
        {
            "name": m.name,
            "engine": m.engine,
            "desired": scaled.get(m.name, m.replicas),
            "states": by_state.get(m.name, {}),
            "serving": by_state.get(m.name, {}).get("ready", 0),
            "pending": pending.get(m.name, 0),
        }
        for m in catalog.models
    ]


def _gpu_grid(gpus: list[admin.GpuInfo]) -> Markup:
    """A node's GPUs as the overview's cells, made here rather than in the template: at
    1,000 nodes of 8 GPUs the template's per-value escaping was most of the page's time."""
    cells = []
    for g in gpus:
        used = g.memory_total - g.memory_free
        # Memory used in fifths, as a class: 8,000 inline styles cost the browser most of
        # a 1,000-node page's time.
        fifths = round(used / g.memory_total * 5) if g.memory_total else 0
        classes = f"gpu m{fifths}" + ("" if g.healthy else " bad") + (" used" if g.in_use else "")
        title = f"GPU {g.index}: {used / 2**30:.0f}/{g.memory_total / 2**30:.0f} GiB"
        if not g.healthy:
            title += f", unhealthy: {g.reason}"
        cells.append(f'<i class="{classes}" title="{escape(title)}"></i>')
    return Markup("".join(cells))


def _read_filter(name: str) -> tuple[str | None, str | None]:
    found = {k: v[0] for k, v in parse_qs(name).items()}
    return found.get("for") or None, found.get("type") or None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _plot_json(points: list[Shown]) -> str:
    """A subject's points as its plots read them: "at", and a line per value; times (the
    percentiles, "..._p95") in milliseconds, as "..._p95_ms"."""
    plot: dict[str, list[Any]] = {"at": [p.at for p in points]}
    for p in points:
        for name, value in p.values.items():
            if _PERCENTILE.fullmatch(name):
                plot.setdefault(f"{name}_ms", []).append(
                    None if value is None else round(value * 1000, 2)
                )
            else:
                plot.setdefault(name, []).append(_round(value))
    return json.dumps(plot)
