"""The dashboard in-process: sign-in by cookie (never a token in a URL), every page rendered
from the control plane's state, a cordon that needs the session and this dashboard's origin,
and the live part that changes when the fleet does."""

from __future__ import annotations

import asyncio
import re

import httpx
import yaml

from modelfleet.controlplane.autoscaler import Scale
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.dashboard import COOKIE, Dashboard
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.core.fleet import Mark
from modelfleet.messages import admin
from modelfleet.messages.wire import Ejection, LoadReport, ModelLoad
from modelfleet.store.calls import Outage
from modelfleet.store.sqlite import SqliteStore

from .test_admin_api import TOKEN, control_plane


def ui_client(cp: ControlPlane) -> tuple[Dashboard, httpx.AsyncClient]:
    dashboard = Dashboard(cp)
    _, admin_app = create_apps(cp, dashboard)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app), base_url="http://cp")
    return dashboard, client


def test_the_dashboard_signs_in_by_cookie_and_shows_the_fleet() -> None:
    cp = control_plane()
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            away = await c.get("/ui/")
            assert away.status_code == 303 and away.headers["location"] == "/ui/login"
            assert (await c.get("/ui/live/overview")).status_code == 401
            assert (await c.get("/ui/login")).status_code == 200
            wrong = await c.post("/ui/login", data={"token": "nope"})
            assert wrong.status_code == 401 and "not the admin token" in wrong.text
            assert COOKIE not in c.cookies
            signed = await c.post("/ui/login", data={"token": TOKEN})
            assert signed.status_code == 303 and signed.headers["location"] == "/ui/"
            cookie = signed.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
            assert TOKEN not in cookie

            overview = await c.get("/ui/")
            assert overview.status_code == 200
            page = overview.text
            assert 'data-model="small"' in page and 'data-model="wide"' in page
            assert 'data-node="a"' in page and 'data-node="b"' in page
            assert "unhealthy: XID 79" in page  # the simulated bad GPU, in its cell's title
            assert 'sse-connect="/ui/live/overview?had=' in page
            # One script, one stylesheet, the stream: and no favicon fetched.
            assert re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', page) == [
                "/ui/static/ui.css",
                "/ui/static/ui.js",
            ]
            assert 'rel="icon" href="data:,"' in page

            for path, expect in (
                ("/ui/nodes/a", "Replicas on it"),
                ("/ui/models/small", "data-plot"),
                ("/ui/pending", "wide: 1 pending"),
                ("/ui/events", "ControlPlaneStarted"),
                ("/ui/usage", "Keys and usage"),
            ):
                got = await c.get(path)
                assert got.status_code == 200 and expect in got.text, path
            assert (await c.get("/ui/nodes/nope")).status_code == 404
            assert (await c.get("/ui/models/nope")).status_code == 404
            js = await c.get("/ui/static/ui.js")
            assert js.status_code == 200 and "htmx" in js.text and "uPlot" in js.text
            again = await c.get("/ui/static/ui.js", headers={"if-none-match": js.headers["etag"]})
            assert again.status_code == 304

            await c.post("/ui/logout")
            assert (await c.get("/ui/")).status_code == 303

    asyncio.run(go())


def test_a_store_outage_leaves_every_plotted_page_up_saying_why() -> None:
    cp = control_plane()
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            cp.calls.outage = Outage(0.0, "PostgreSQL does not answer")
            for path in ("/ui/models/small?range=7d", "/ui/nodes/a", "/ui/usage?range=6h"):
                got = await c.get(path)
                assert got.status_code == 200, (path, got.text[-500:])
                assert "No plots now:" in got.text and "does not answer" in got.text, path
            cp.calls.outage = None
            back = await c.get("/ui/models/small?range=7d")
            assert 'class="current" aria-current="page">7d<' in back.text
            assert "a point per 1 h" in back.text  # 7 d of quarter hours, 4 to a point
            assert '&amp;range=7d"' in back.text  # and its live stream is the 7 d one

    asyncio.run(go())


def test_a_cordon_from_the_page_needs_the_session_and_this_origin() -> None:
    cp = control_plane()
    dashboard, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            mark = {"mark": "cordoned"}
            assert (await c.post("/ui/nodes/a/mark", data=mark)).status_code == 401
            await c.post("/ui/login", data={"token": TOKEN})
            before = await dashboard.parts.render_part("overview", "")
            # Rendered again with nothing changed, every live part is the same: its stream
            # sends nothing.
            for part, name in (("overview", ""), ("node", "a"), ("events", ""), ("model", "small")):
                assert await dashboard.parts.render_part(
                    part, name
                ) == await dashboard.parts.render_part(part, name)
            elsewhere = {"origin": "http://evil.example"}
            refused = await c.post("/ui/nodes/a/mark", data=mark, headers=elsewhere)
            assert refused.status_code == 403
            assert cp.state.nodes["a"].mark.mark is Mark.NONE
            bad = await c.post("/ui/nodes/a/mark", data={"mark": "locked"})
            assert bad.status_code == 400 and "one of" in bad.text
            gone = await c.post("/ui/nodes/nope/mark", data=mark)
            assert gone.status_code == 404 and "no node 'nope'" in gone.text
            done = await c.post("/ui/nodes/a/mark", data=mark, headers={"origin": "http://cp"})
            assert done.status_code == 204
            assert cp.state.nodes["a"].mark.mark is Mark.CORDONED
            after = await dashboard.parts.render_part("overview", "")
            assert before != after and re.search(r'class="mark">cordoned<', after or "")
            page = (await c.get("/ui/nodes/a")).text
            # A drain's confirmation names what moves, and promises no room it has not seen.
            [replica] = [
                r for r in cp.state.replicas if cp.state.replicas[r].replica.shards[0].node == "a"
            ]
            assert f"replaced elsewhere before it stops, where there is room ({replica}" in page
            assert "ctl drain a --dry-run" in page
            assert "Uncordon" in page and ">Cordon<" not in page

    asyncio.run(go())


def test_a_model_that_follows_its_load_shows_its_count_bounds_and_why() -> None:
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    scaled = {"min": 0, "max": 4, "target_in_flight": 8}
    keeper.apply(
        yaml.safe_dump({"models": [{"name": "auto", "engine": "sim", "autoscale": scaled}]}),
        "api",
        0.0,
    )
    cp = ControlPlane(ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), keeper)
    cp.autoscaler.scales["auto"] = Scale(3, "up at once: 20 request(s) held", 0.0)
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            overview = (await c.get("/ui/")).text
            assert re.search(r'class="serving">0</span> / 3<', overview), "the count, not min"
            page = (await c.get("/ui/models/auto")).text
            assert "follows its load: 0..4 replicas, 8.0 requests in flight each" in page
            assert "up at once: 20 request(s) held" in page

    asyncio.run(go())


def test_the_events_page_filters_by_what_they_regard_and_their_type() -> None:
    """Issue 41: the events page showed the newest 200 of everything, with no filter."""
    cp = control_plane()
    cp.events.normal("NodeMarked", "node/a", "marked cordoned (was none)")
    cp.events.warning("GpuUnhealthy", "node/b", "gpu 1: XID 79")
    cp.events.normal("KeyCreated", "key/app", "prefix mf-abc")
    _, client = ui_client(cp)

    def rows(page: str) -> set[str]:
        return set(re.findall(r"(node/[ab]|key/app)", page.split('class="filter"')[1]))

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            every = (await c.get("/ui/events")).text
            assert rows(every) >= {"node/a", "node/b", "key/app"}
            about_b = (await c.get("/ui/events", params={"for": "node/b"})).text
            assert rows(about_b) == {"node/b"} and 'value="node/b"' in about_b
            warned = (await c.get("/ui/events", params={"type": "warning"})).text
            assert "node/b" in rows(warned) and "key/app" not in rows(warned)
            nodes = (await c.get("/ui/events", params={"for": "node", "type": "normal"})).text
            assert "node/a" in rows(nodes) and "node/b" not in rows(nodes)
            # The page's stream is the filter's: its live part is the same filter's.
            live = re.search(r'sse-connect="([^"]+)"', about_b)
            assert live is not None and "/ui/live/events/for%3Dnode%252Fb" in live.group(1)

    asyncio.run(go())


def test_a_replica_has_a_page_of_its_own_linked_from_its_model() -> None:
    """Issue 41: restarts, the last error and the load of a replica were in ctl only."""
    cp = control_plane()  # small's replica on a: ready, pid 123, its log "loaded"
    [rid] = [r for r, rec in cp.state.replicas.items() if rec.replica.shards[0].node == "a"]
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            model = (await c.get("/ui/models/small")).text
            assert f'href="/ui/replicas/{rid}"' in model
            page = (await c.get(f"/ui/replicas/{rid}")).text
            assert f"<h1>Replica {rid}</h1>" in page and 'class="ok">ready<' in page
            assert "<td>123</td>" in page and 'class="restarts">0<' in page
            assert "load unknown" in page  # no router has said yet
            assert '<pre class="log">loaded</pre>' in page
            gone = await c.get("/ui/replicas/nope")
            assert gone.status_code == 404
            # A router's reading of its engine: requests there and the KV cache in use.
            load = ModelLoad(in_flight=2, engines=6, replicas={rid: (2, 6)}, cache={rid: 0.5})
            report = LoadReport(models={"small": load})
            cp.loads.reports["http://router"] = (cp.clock.monotonic(), report)
            page = (await c.get(f"/ui/replicas/{rid}")).text
            assert "load 6.0" in page and "at its engine: 6 running or waiting" in page
            assert "KV cache 50 % in use" in page

    asyncio.run(go())


def test_a_replica_out_of_rotation_shows_so_on_every_page_at_once() -> None:
    """Issue 57: the overview kept "1 / 1" serving, and node and model pages "ready", while a
    router had the replica out of rotation: the parts' cache ignored ejections."""
    cp = control_plane()  # small's replica on a: ready
    [rid] = [r for r, rec in cp.state.replicas.items() if rec.replica.shards[0].node == "a"]
    parts = Dashboard(cp).parts
    pages = [("overview", ""), ("node", "a"), ("model", "small"), ("replica", rid)]

    def serving(html: str) -> int:
        found = re.search(r'<a href="/ui/models/small">small</a></td>.*?class="serving">(\d+)<',
                          html, re.S)  # fmt: skip
        assert found is not None
        return int(found.group(1))

    def replica_state(html: str) -> str:
        row = re.search(rf'data-replica="{rid}">.*?</tr>', html, re.S)
        if row is None:  # the replica's own page
            row = re.search(r"<h1>Replica .*", html, re.S)
        assert row is not None
        return "out-of-rotation" if "out-of-rotation" in row.group(0) else "ready"

    async def go() -> None:
        before = {p: await parts.render_part(*p) for p in pages}
        assert serving(before["overview", ""]) == 1
        assert all(replica_state(before[p]) == "ready" for p in pages[1:])
        out = Ejection(why="engine unreachable", left_s=5.0, times=1)
        report = LoadReport(ejected={rid: out})
        cp.loads.reports["http://router"] = (cp.clock.monotonic(), report)
        after = {p: await parts.render_part(*p) for p in pages}
        assert serving(after["overview", ""]) == 0
        assert [p for p in pages[1:] if replica_state(after[p]) != "out-of-rotation"] == []
        cp.loads.reports["http://router"] = (cp.clock.monotonic(), LoadReport())
        back = {p: await parts.render_part(*p) for p in pages}
        assert serving(back["overview", ""]) == 1
        assert all(replica_state(back[p]) == "ready" for p in pages[1:])

    asyncio.run(go())


def test_the_playground_s_calls_need_a_session_this_origin_and_a_router_to_send_to() -> None:
    cp = control_plane()  # its config names no router
    _, client = ui_client(cp)
    chat = {"key": "mf-x", "model": "small", "messages": [{"role": "user", "content": "hi"}]}

    async def go() -> None:
        async with client as c:
            assert (await c.post("/ui/playground/key")).status_code == 401
            assert (await c.post("/ui/playground/chat", json=chat)).status_code == 401
            await c.post("/ui/login", data={"token": TOKEN})
            elsewhere = {"origin": "http://evil.example"}
            made = await c.post("/ui/playground/key", headers=elsewhere)
            assert made.status_code == 403 and not cp.keys.keys  # no key made
            page = (await c.get("/ui/playground")).text
            assert "<option>small</option>" in page and "names its <code>client_url</code>" in page
            nowhere = await c.post("/ui/playground/chat", json=chat)
            assert nowhere.status_code == 503 and "client_url" in nowhere.json()["error"]
            made = await c.post("/ui/playground/key")
            assert made.status_code == 200 and made.json()["key"].startswith("mf-")
            assert [k.startswith("playground-") for k in cp.keys.keys] == [True]

    asyncio.run(go())


def test_the_playground_offers_each_adapter_as_the_router_takes_it() -> None:
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    adapters = [{"name": "sql", "source": "/lora/sql"}, {"name": "chat", "source": "org/chat"}]
    catalog = {"models": [{"name": "base", "engine": "sim", "adapters": adapters}]}
    keeper.apply(yaml.safe_dump(catalog), "api", 0.0)
    cp = ControlPlane(ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), keeper)
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            page = (await c.get("/ui/playground")).text
            offered = re.findall(r"<option>([^<]+)</option>", page)
            assert offered == ["base", "base:sql", "base:chat"]  # router/table.adapter_alias

    asyncio.run(go())


def test_events_are_shown_by_last_seen_a_model_with_its_replicas_a_node_with_its_shards() -> None:
    """Issue 57: the events page ordered by first seen, its model filter dropped the model's
    replicas, and a node's page omitted its shards' failures (they regard their replica)."""
    cp = control_plane()  # a replica of small ready on a
    [(rid, _)] = list(cp.state.nodes["a"].shards)
    cp.record_news()
    clock = iter(range(2_000_000_000, 2_000_000_100))
    cp.events.now = lambda: float(next(clock))
    cp.events.warning("ShardFailed", f"replica/{rid}", "shard 0 on a: engine exited (1)")
    cp.events.normal("NodeMarked", "node/a", "marked cordoned (was none)")
    cp.events.normal("NodeMarked", "node/ab", "marked cordoned (was none)")
    cp.events.warning("ShardFailed", f"replica/{rid}", "shard 0 on a: engine exited (1)")  # again
    reasons = [(e.reason, e.regarding) for e in cp.read_events("model/small")]
    assert ("ReplicaPlaced", f"replica/{rid}") in reasons
    assert reasons[-1] == ("ShardFailed", f"replica/{rid}")  # seen last, though first earlier
    on_a = [(e.reason, e.regarding) for e in cp.read_events("node/a")]
    assert ("ShardFailed", f"replica/{rid}") in on_a and ("NodeMarked", "node/ab") not in on_a
    _, client = ui_client(cp)

    async def go() -> None:
        async with client as c:
            await c.post("/ui/login", data={"token": TOKEN})
            node = (await c.get("/ui/nodes/a")).text
            assert "engine exited (1)" in node
            page = (await c.get("/ui/events", params={"for": "model/small"})).text
            rows = re.findall(r"<tr class=\"\w+\"><td[^>]*>[^<]*</td><td>\w+</td><td>(\w+)", page)
            assert rows[0] == "ShardFailed" and "ReplicaPlaced" in rows  # the last seen first
            assert "NodeMarked" not in rows

    asyncio.run(go())


def test_the_keys_page_says_when_limits_are_counted_per_router_worker() -> None:
    """Issue 57: the Keys page showed rpm 20 while about 38 a minute got through a router of
    two workers and no limits_store, and said nothing of it."""
    cp = control_plane()
    asyncio.run(cp.keys.create(admin.KeyCreate(name="limited", rpm=20), {"small": "small"}, 0.0))

    async def keys_page() -> str:
        async with ui_client(cp)[1] as c:
            await c.post("/ui/login", data={"token": TOKEN})
            return (await c.get("/ui/usage")).text

    assert "per router worker" not in asyncio.run(keys_page())  # no router said so
    cp.loads.reports["http://r1"] = (0.0, LoadReport(limit_counts=2))
    cp.loads.reports["http://r2"] = (0.0, LoadReport())
    page = asyncio.run(keys_page())
    assert re.search(r"rpm 20\s*<span [^>]*>\(counted per router worker: up to 2 times it", page)
    assert "Limits are counted per router worker at http://r1 (2 workers)" in page
    assert "http://r2" not in page
