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
import math
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

from modelfleet.controlplane.dashboard_parts import DEFAULT_RANGE, HEARD_NOW_S, LiveParts
from modelfleet.controlplane.doors import retry_after
from modelfleet.controlplane.logs import LogUnanswered
from modelfleet.controlplane.nodes import MarkRefused, mark_node
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.playground import Playground
from modelfleet.controlplane.series import RANGES
from modelfleet.core.fleet import Mark
from modelfleet.http.web import bearer_matches, from_elsewhere, read_at_most

UI = Path(__file__).parent / "ui"
COOKIE = "modelfleet_ui"
SESSION_TTL_S = 12 * 3600.0
LIVE_EVERY_S = 0.5
LOG_EVERY_S = 1.0
LOG_WAIT_S = 15.0
# A live stream says it is alive at least this often, changed or not: a page that hears
# nothing for a few of these tells its viewer it is no longer live (ui.js).
ALIVE_EVERY_S = 2.0
PARTS = ("overview", "node", "model", "replica", "pending", "events", "usage")
PLOTTED = frozenset({"model", "node", "usage"})  # the pages that load the plot library

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
        self.parts = LiveParts(cp, self.env)

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
        # Counted as its head arrives, before its body (the token) is read: see doors.py.
        taken = doors.attempt("sign-in", source)
        if taken.wait > 0:
            wait = retry_after(taken)
            error = f"Too many wrong tokens from here: try again in {wait} s."
            answer = self._html("login.html", {"error": error}, 429)
            answer.headers["retry-after"] = wait
            return answer
        form = await _form(request)
        token = form.get("token", "")
        if not bearer_matches(f"Bearer {token}", self.cp.config.admin_token):
            doors.failed("sign-in", source, "not the admin token", taken)
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
            html = await self.parts.render_part(part, name, span)
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
            await mark_node(self.cp, request.path_params["name"], mark, None)
        except MarkRefused as exc:
            return Response(f"{exc}\n", status_code=exc.status)
        self._nudge()  # the live parts show it now, not at their next turn
        return Response(status_code=204)

    def _nudge(self) -> None:
        nudged, self._nudged = self._nudged, asyncio.Event()
        nudged.set()

    # -- live parts ------------------------------------------------------------------------

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
                html = await self.parts.render_part(part, name, span)
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
            run: str | None = None  # followed across the engine's restarts (`read_log`)
            while not self.closing.is_set():
                nodes = _nodes_of(cp, replica)
                if nodes is None or shard >= len(nodes):
                    yield _event("lines", _log_html([f"(no replica {replica} shard {shard})"]))
                    return
                asking = asyncio.ensure_future(
                    cp.logs.ask(nodes[shard], replica, shard, 0, 200, offset, LOG_WAIT_S, run=run)
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
                    offset, run = got.offset, got.run
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
