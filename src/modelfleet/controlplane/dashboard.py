"""The web dashboard at `/ui/` on the admin listener: the fleet as pages, kept live.

Server-rendered (Jinja2 templates in `ui/templates`), with htmx and its server-sent-events
extension and uPlot vendored as files (`ui/static/vendor`, versions in VERSIONS). Each page
is its HTML, one script, one stylesheet (and the plot library where it plots), and one
event stream (`/ui/live/PART`) that renders the page's live part again every
`LIVE_EVERY_S` and sends it only when it changed: a change shows within a second, and an
idle fleet costs the browser nothing.

Sign-in: the login page takes the admin token and sets a session cookie (HttpOnly,
SameSite=Strict, Secure over TLS), never a token in a URL. Sessions live in the control
plane's memory: a restart signs everyone out. Changes (cordon, drain, uncordon) are form
posts that need the session cookie, which SameSite=Strict keeps off other sites' requests,
and an Origin, when the browser sends one, that is this listener's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from modelfleet.controlplane import views
from modelfleet.controlplane.logs import LogUnanswered
from modelfleet.controlplane.plane import ControlPlane, MarkRefused
from modelfleet.controlplane.playground import Playground
from modelfleet.controlplane.series import MAX_SHOWN, RANGES, Shown, shown, source_step
from modelfleet.core.fleet import Mark
from modelfleet.http.web import bearer_matches, from_elsewhere, read_at_most
from modelfleet.messages import admin
from modelfleet.store import StoredEvent, StoredPoint, StoredUsage, StoreError

UI = Path(__file__).parent / "ui"
COOKIE = "modelfleet_ui"
SESSION_TTL_S = 12 * 3600.0
LIVE_EVERY_S = 0.5
LOG_EVERY_S = 1.0
LOG_WAIT_S = 15.0
EVENTS_SHOWN = 200
HEARD_NOW_S = 5.0  # a node heard from this recently shows as heard "now"
# A live stream says it is alive at least this often, changed or not: a page that hears
# nothing for a few of these tells its viewer it is no longer live (ui.js).
ALIVE_EVERY_S = 2.0
PARTS = ("overview", "node", "model", "replica", "pending", "events", "usage")
PLOTTED = frozenset({"model", "node", "usage"})  # the pages that load the plot library
# The series each plotted page shows (`controlplane/series.py`), by its part.
PLOTS = {"model": "model", "node": "node", "usage": "key"}
DEFAULT_RANGE = "1h"
# A plot's points are read from the store again when the recorder wrote new ones, and at
# least this often (another control plane may write them: this one follows).
PLOT_READ_EVERY_S = 5.0
_PERCENTILE = re.compile(r".+_p\d+")  # a plotted value that is a time: shown in ms

# What each bundle is made of, in order: ours last, so that it may use what comes before.
BUNDLES = {
    "ui.js": ("text/javascript", ["vendor/htmx.min.js", "vendor/sse.min.js", "ui.js"]),
    "plot.js": ("text/javascript", ["vendor/uPlot.iife.min.js"]),
    "ui.css": ("text/css", ["vendor/uPlot.min.css", "ui.css"]),
}


@dataclass
class Sessions:
    """Signed-in browsers: session id -> when it ends (the control plane's monotonic clock)."""

    clock: Callable[[], float]
    ends: dict[str, float] = field(default_factory=dict)

    def new(self) -> str:
        now = self.clock()
        self.ends = {k: end for k, end in self.ends.items() if end > now}
        session = secrets.token_urlsafe(32)
        self.ends[session] = now + SESSION_TTL_S
        return session

    def valid(self, session: str | None) -> bool:
        end = self.ends.get(session or "")
        return end is not None and end > self.clock()

    def drop(self, session: str | None) -> None:
        self.ends.pop(session or "", None)


def _bundle(name: str) -> tuple[bytes, str, str]:
    kind, parts = BUNDLES[name]
    body = b"\n".join((UI / "static" / p).read_bytes() for p in parts)
    return body, kind, hashlib.sha256(body).hexdigest()[:16]


class Dashboard:
    """The dashboard's pages and streams over one control plane."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.sessions = Sessions(cp.clock.monotonic)
        self.playground = Playground(cp, self._signed_in, self._html)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(UI / "templates"),
            autoescape=jinja2.select_autoescape(["html"]),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["gib"] = lambda n: f"{n / 2**30:.1f}"
        # Times as they were, not "5s ago": a live part changes only when the fleet does.
        self.env.filters["utc"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
        self.env.filters["q"] = lambda s: quote(str(s), safe="")
        self.env.filters["heard"] = lambda s: "now" if s < HEARD_NOW_S else f"{int(s)}s ago"
        self.env.filters["span"] = _span_words
        self.bundles = {name: _bundle(name) for name in BUNDLES}
        self.closing = asyncio.Event()  # set when the control plane stops: streams end
        self._nudged = asyncio.Event()  # set, and replaced, when a change is made here
        # (part, name, range) -> (basis, html)
        self._rendered: dict[tuple[str, str, str], tuple[Any, str]] = {}
        self._plotted: dict[tuple[str, str | None, str], Plotted] = {}

    async def run(self) -> None:
        """Held while the control plane runs; when it stops, every live stream ends, so that
        the admin listener's drain does not wait on them."""
        try:
            await asyncio.Event().wait()
        finally:
            self.closing.set()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/login", self.login_page, methods=["GET"]),
                Route("/login", self.login, methods=["POST"]),
                Route("/logout", self.logout, methods=["POST"]),
                Route("/static/{name}", self.static),
                Route("/", self.page("overview")),
                Route("/pending", self.page("pending")),
                Route("/events", self.page("events")),
                Route("/usage", self.page("usage")),
                Route("/nodes/{name}", self.page("node")),
                Route("/models/{name:path}", self.page("model")),
                Route("/replicas/{name:path}", self.page("replica")),
                Route("/logs/{name:path}", self.logs_page),
                Route("/nodes/{name}/mark", self.mark, methods=["POST"]),
                Route("/alive", self.alive),
                *self.playground.routes(),
                Route("/live/{part}", self.live),
                Route("/live/{part}/{name:path}", self.live),
                Route("/live-logs/{name:path}", self.live_logs),
            ]
        )

    # -- sign-in ---------------------------------------------------------------------------

    def _signed_in(self, request: Request) -> bool:
        return self.sessions.valid(request.cookies.get(COOKIE))

    async def login_page(self, request: Request) -> Response:
        return self._html("login.html", {"error": ""})

    async def login(self, request: Request) -> Response:
        source = request.client.host if request.client else "?"
        doors = self.cp.doors
        wait = doors.wait("sign-in", source)
        if wait > 0:
            error = f"Too many wrong tokens from here: try again in {math.ceil(wait)} s."
            answer = self._html("login.html", {"error": error}, 429)
            answer.headers["retry-after"] = str(math.ceil(wait))
            return answer
        form = await _form(request)
        token = form.get("token", "")
        if not bearer_matches(f"Bearer {token}", self.cp.config.admin_token):
            doors.failed("sign-in", source, "not the admin token")
            return self._html("login.html", {"error": "That is not the admin token."}, 401)
        doors.succeeded("sign-in", source)
        response = RedirectResponse("/ui/", status_code=303)
        response.set_cookie(
            COOKIE,
            self.sessions.new(),
            max_age=int(SESSION_TTL_S),
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        self.sessions.drop(request.cookies.get(COOKIE))
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    async def static(self, request: Request) -> Response:
        got = self.bundles.get(request.path_params["name"])
        if got is None:
            return Response("no such file\n", status_code=404)
        body, kind, tag = got
        headers = {"etag": f'"{tag}"', "cache-control": "max-age=3600"}
        if request.headers.get("if-none-match") == f'"{tag}"':
            return Response(status_code=304, headers=headers)
        return Response(body, media_type=kind, headers=headers)

    # -- pages -------------------------------------------------------------------------------

    def page(self, part: str) -> Callable[[Request], Any]:
        async def show(request: Request) -> Response:
            if not self._signed_in(request):
                return RedirectResponse("/ui/login", status_code=303)
            name = request.path_params.get("name", "")
            if part == "events":  # its filter is its name: the stream is the filter's
                name = _event_filter(
                    request.query_params.get("for"), request.query_params.get("type")
                )
            span = _range(request)
            html = await self.render_part(part, name, span)
            if html is None:
                return self._html("missing.html", {"what": f"{part} {name}"}, 404)
            # The stream is told what the page holds, and sends nothing until that changes.
            live = f"/ui/live/{part}" + (f"/{quote(name, safe='')}" if name else "")
            live += f"?had={_digest(html)}&range={span}"
            page = {"part": part, "live": live, "name": name, "plots": part in PLOTTED}
            return self._html("page.html", {**page, "html": Markup(html)})

        return show

    async def logs_page(self, request: Request) -> Response:
        if not self._signed_in(request):
            return RedirectResponse("/ui/login", status_code=303)
        name = request.path_params["name"]
        shard = _int(request.query_params.get("shard"), 0)
        return self._html("logs.html", {"name": name, "shard": shard})

    def _html(self, template: str, context: dict[str, Any], status: int = 200) -> Response:
        return HTMLResponse(self.env.get_template(template).render(**context), status)

    # -- changes -----------------------------------------------------------------------------

    async def mark(self, request: Request) -> Response:
        if not self._signed_in(request):
            return Response("sign in first\n", status_code=401)
        if from_elsewhere(request):
            return Response("a change must come from this dashboard\n", status_code=403)
        form = await _form(request)
        try:
            mark = Mark(form.get("mark", ""))
        except ValueError:
            return Response("mark: one of none, cordoned, draining\n", status_code=400)
        if mark is Mark.REVOKED:
            return Response("revoke a node with `ctl nodes revoke`\n", status_code=400)
        try:
            await self.cp.mark_node(request.path_params["name"], mark, None)
        except MarkRefused as exc:
            return Response(f"{exc}\n", status_code=exc.status)
        self._nudge()  # the live parts show it now, not at their next turn
        return Response(status_code=204)

    def _nudge(self) -> None:
        nudged, self._nudged = self._nudged, asyncio.Event()
        nudged.set()

    # -- live parts ------------------------------------------------------------------------

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
            width=max(1, math.ceil(seconds / step / MAX_SHOWN)) * step,
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
            shown = {"span": span, "ranges": list(RANGES), "plotted": stored.plotted}
            context = {**context, **shown, "problem": stored.problem}
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
        basis: tuple[Any, ...] = (
            state.version,
            cp.catalogs.current.version,
            cp.frozen,
            state.pending,
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
            basis += (stored.events[-1].id if stored.events else 0, stored.problem)
        if stored.plotted is not None:
            basis += (stored.plotted.version, stored.problem)
        if part == "replica":
            seen = self._replica(name)
            basis += (
                tuple(cp.loads.ejections(now).get(name, ())),
                *((seen["load"], seen["at_engine"], seen["cache"]) if seen else ()),
            )
        return basis

    async def live(self, request: Request) -> Response:
        if not self._signed_in(request):
            return Response("sign in first\n", status_code=401)
        part, name = request.path_params["part"], request.path_params.get("name", "")
        if part not in PARTS:
            return Response("no such part\n", status_code=404)
        span = _range(request)

        async def stream() -> AsyncIterator[bytes]:
            last = request.query_params.get("had")  # the digest of what the page holds
            said = -math.inf  # when it last said it is alive
            while not self.closing.is_set():
                html = await self.render_part(part, name, span)
                html = html if html is not None else f"<p>{part} {name} is gone.</p>"
                digest = _digest(html)
                if digest != last:
                    last = digest
                    yield _event("part", html)
                now = self.cp.clock.monotonic()
                if now - said >= ALIVE_EVERY_S:
                    said = now
                    at = time.localtime(self.cp.clock.time())
                    yield _event("alive", time.strftime("%H:%M:%S", at))
                await self._pause(LIVE_EVERY_S)

        return _streaming(stream())

    async def alive(self, request: Request) -> Response:
        """204 while this browser is signed in, else 401: how a page whose stream went quiet
        tells a control plane gone (no answer) from a session gone (it restarted)."""
        return Response(status_code=204 if self._signed_in(request) else 401)

    async def live_logs(self, request: Request) -> Response:
        """The engine's output: its last 200 lines, then what it writes, each second."""
        if not self._signed_in(request):
            return Response("sign in first\n", status_code=401)
        replica = request.path_params["name"]
        shard = _int(request.query_params.get("shard"), 0)
        cp = self.cp

        async def stream() -> AsyncIterator[bytes]:
            offset: int | None = None
            while not self.closing.is_set():
                nodes = _nodes_of(cp, replica)
                if nodes is None or shard >= len(nodes):
                    yield _event("lines", _log_html([f"(no replica {replica} shard {shard})"]))
                    return
                asking = asyncio.ensure_future(
                    cp.logs.ask(nodes[shard], replica, shard, 0, 200, offset, LOG_WAIT_S)
                )
                try:
                    while not (await asyncio.wait({asking}, timeout=ALIVE_EVERY_S))[0]:
                        yield _event("alive", "")  # the agent takes its time: still live
                finally:
                    asking.cancel()  # the viewer left meanwhile: nobody reads the answer
                try:
                    got = asking.result()
                except LogUnanswered as exc:
                    yield _event("lines", _log_html([f"({exc})"]))
                else:
                    if got.error:
                        yield _event("lines", _log_html([f"({nodes[shard]}: {got.error})"]))
                        return
                    if got.lines:
                        yield _event("lines", _log_html(got.lines))
                    offset = got.offset
                yield _event("alive", "")
                await self._pause(LOG_EVERY_S)

        return _streaming(stream())

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less when the control plane stops or a change is made here."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.closing, self._nudged)]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # -- what each part shows ----------------------------------------------------------------

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
        now = cp.clock.monotonic()
        ejected = cp.loads.ejections(now).get(rid, [])
        model = (cp.loads.loads(now) or {}).get(record.replica.model)
        return {
            "replica": views.replica_view(cp.state, record, ejected),
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
        return {"rows": stored.usage, "keys": keys, "plot": json.dumps(plot)}


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


def _nodes_of(cp: ControlPlane, replica: str) -> tuple[str, ...] | None:
    record = cp.state.replicas.get(replica)
    if record is not None:
        return tuple(p.node for p in record.replica.shards)
    return cp.state.dropped.get(replica)


def _digest(html: str) -> str:
    return hashlib.blake2b(html.encode(), digest_size=8).hexdigest()


def _event_filter(regarding: str | None, kind: str | None) -> str:
    """The events page's filter as its part's name: what it regards (a kind, node, or one
    object, node/NAME) and its type (normal, warning); empty: every event."""
    chosen = {
        "for": (regarding or "").strip(),
        "type": kind if kind in ("normal", "warning") else "",
    }
    return urlencode({k: v for k, v in chosen.items() if v})


def _read_filter(name: str) -> tuple[str | None, str | None]:
    found = {k: v[0] for k, v in parse_qs(name).items()}
    return found.get("for") or None, found.get("type") or None


def _event(name: str, html: str) -> bytes:
    data = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
    return f"event: {name}\n{data}\n".encode()


def _log_html(lines: list[str]) -> str:
    return "".join(f"<div>{escape(line)}</div>" for line in lines)


def _streaming(events: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _form(request: Request) -> dict[str, str]:
    """A small url-encoded form (the login, a mark): its fields, the first of each name; none
    for a body past 4 KiB."""
    raw = await read_at_most(request, 4096)
    if raw is None:
        return {}
    fields = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


def _int(text: str | None, default: int) -> int:
    try:
        return max(0, int(text)) if text is not None else default
    except ValueError:
        return default


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


def _span_words(seconds: int) -> str:
    """Seconds as a plot's caption says them: "10 s", "1 min", "15 min", "2 h"."""
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


def _range(request: Request) -> str:
    """The plots' range a page asks for (`?range=6h`); the default for anything else."""
    asked = request.query_params.get("range", DEFAULT_RANGE)
    return asked if asked in RANGES else DEFAULT_RANGE
