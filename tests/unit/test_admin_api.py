"""The admin API's schema: every route is in `/openapi.json`, and every answer validates
against what the document says of it, errors included."""

from __future__ import annotations

import asyncio
import datetime
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import yaml
from fastapi.routing import APIRoute
from jsonschema import Draft202012Validator
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.admin_api import RESOURCES
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig, RouterTarget
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.ctl.render import print_mark
from modelfleet.messages import admin
from modelfleet.messages.wire import AgentReport, ShardReport, ShardState
from modelfleet.security.pki import CertificateAuthority
from modelfleet.store import StoredKey, StoredMark
from modelfleet.store.sqlite import SqliteStore

TOKEN = "admin-token-123"
CATALOG = {
    "models": [
        {"name": "small", "engine": "sim", "replicas": 2},
        {"name": "wide", "engine": "sim", "gpus_per_shard": 8},
    ]
}

# One request per route that it answers with 200, and one it refuses: (method, path, body,
# status). Every route of the app must be here (checked below), so a new route needs a line.
CALLS: list[tuple[str, str, str | None, int]] = [
    ("GET", "/v1/status", None, 200),
    ("GET", "/v1/nodes", None, 200),
    ("POST", "/v1/nodes/a/mark", '{"mark": "cordoned"}', 200),
    ("POST", "/v1/nodes/a/mark", '{"mark": "draining", "grace_s": 30}', 200),
    ("POST", "/v1/nodes/a/mark", '{"mark": "draining", "dry_run": true}', 200),
    ("POST", "/v1/nodes/a/mark", '{"mark": "locked"}', 400),
    ("POST", "/v1/nodes/nope/mark", '{"mark": "none"}', 404),
    ("GET", "/v1/replicas", None, 200),
    ("GET", "/v1/replicas/{replica}", None, 200),
    ("GET", "/v1/replicas/nope", None, 404),
    ("GET", "/v1/explain/small", None, 200),
    ("GET", "/v1/explain/wide", None, 200),
    ("GET", "/v1/explain/nope", None, 404),
    ("POST", "/v1/rebalance?dry_run=true", None, 200),
    ("POST", "/v1/rebalance?model=small", None, 200),
    ("POST", "/v1/rebalance?model=nope", None, 404),
    ("GET", "/v1/catalog", None, 200),
    ("GET", "/v1/catalog/history?limit=5", None, 200),
    ("GET", "/v1/catalog/history?limit=0", None, 400),
    ("PUT", "/v1/catalog?dry_run=true", yaml.safe_dump(CATALOG), 200),
    ("PUT", "/v1/catalog", yaml.safe_dump(CATALOG), 200),
    ("PUT", "/v1/catalog", "models:\n  - name: x\n    engine: vlm\n", 422),
    ("GET", "/v1/routing", None, 200),
    ("DELETE", "/v1/nodes/a", None, 409),
    ("DELETE", "/v1/nodes/nope", None, 404),
    ("DELETE", "/v1/nodes/b?force=true", None, 200),
    (
        "POST",
        "/v1/keys",
        '{"name": "alice", "models": ["small"], "rpm": 60, "expires": "30d"}',
        200,
    ),
    ("POST", "/v1/keys", '{"name": "alice"}', 409),
    ("POST", "/v1/keys", '{"name": "bob", "rpm": 0}', 400),
    ("POST", "/v1/keys", '{"name": "bob", "models": ["nope"]}', 409),  # not in the catalog now
    ("POST", "/v1/keys", '{"name": "bob", "expires": "2020-01-01"}', 409),  # past, by the clock
    ("POST", "/v1/keys", '{"name": "bob", "expires": "2027-02-29"}', 400),  # no such date
    ("GET", "/v1/keys", None, 200),
    ("PATCH", "/v1/keys/alice", '{"tpm": 1000, "clear": ["rpm"]}', 200),
    ("PATCH", "/v1/keys/alice", '{"rpm": 5, "clear": ["rpm"]}', 400),
    ("PATCH", "/v1/keys/nope", '{"tpm": 1000}', 404),
    ("DELETE", "/v1/keys/alice", None, 200),
    ("DELETE", "/v1/keys/alice", None, 404),
    ("GET", "/v1/usage?since=7d&key=alice", None, 200),
    ("GET", "/v1/usage?since=forever", None, 400),
    ("POST", "/v1/join-tokens", '{"ttl": "2h", "uses": 2}', 200),
    ("POST", "/v1/join-tokens", '{"ttl": "soon"}', 400),
    ("POST", "/v1/join-tokens", '{"uses": 0}', 400),
    ("GET", "/v1/join-tokens", None, 200),
    ("GET", "/v1/credentials", None, 200),
    ("DELETE", "/v1/join-tokens/nope", None, 404),
    ("POST", "/v1/nodes/a/revoke", None, 409),  # it reports with the shared agent token
    ("POST", "/v1/nodes/nope/revoke", None, 404),
    ("GET", "/v1/events?for=node/a&since=1h", None, 200),
    ("GET", "/v1/events?since=soon", None, 400),
    ("GET", "/v1/logs/nope", None, 404),
    ("GET", "/v1/logs/{replica}?shard=3", None, 404),
]


def control_plane() -> ControlPlane:
    """A control plane with two nodes, one ready replica and one pending model."""
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    keeper.apply(yaml.safe_dump(CATALOG), "api", 0.0)
    ca = CertificateAuthority.create("test CA", datetime.datetime.now(datetime.UTC))
    cp = ControlPlane(ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), keeper, ca=ca)
    now = time.monotonic()
    gpus = SimulatedGpus("2x80GB", {1: "XID 79"})
    for node in ("a", "b"):
        report = AgentReport(
            node=node, boot_id="b", seq=1, address="127.0.0.1", gpus=gpus.gpus(), shards=[]
        )
        cp.state.take_report(report, keeper.current, now)
    cp.reconcile_once(now)
    [shard] = cp.assignments.of("a", keeper.current).shards
    ready = ShardReport.of(shard, ShardState.READY, port=9000, pid=123, log_tail=["loaded"])
    report = AgentReport(
        node="a", boot_id="b", seq=2, address="127.0.0.1", gpus=gpus.gpus(), shards=[ready]
    )
    cp.state.take_report(report, keeper.current, now)
    return cp


def admin_client(cp: ControlPlane, source: str = "127.0.0.1") -> httpx.AsyncClient:
    """A client of `cp`'s admin API, in-process, with the admin token, from address
    `source`."""
    _, admin_app = create_apps(cp)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=admin_app, client=(source, 123)),
        base_url="http://cp",
        headers={"authorization": f"Bearer {TOKEN}"},
    )


def answer_schema(doc: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    """The JSON schema the document gives for one answer, with its components to resolve
    `$ref`s against."""
    operation = doc["paths"][path][method.lower()]
    responses = operation["responses"]
    assert str(status) in responses, f"{method} {path}: status {status} is not documented"
    schema = responses[str(status)]["content"]["application/json"]["schema"]
    return {**schema, "components": doc["components"]}


def template_of(path: str, doc: dict[str, Any]) -> str:
    """The document's path template that `path` (without its query) falls under."""
    bare = path.split("?", 1)[0].split("/")
    for template in doc["paths"]:
        parts = template.split("/")
        if len(parts) == len(bare) and all(
            t == b or t.startswith("{") for t, b in zip(parts, bare, strict=True)
        ):
            return str(template)
    raise AssertionError(f"{path} is under no path of the document")


def test_every_admin_route_is_documented_and_every_answer_matches_the_document() -> None:
    cp = control_plane()
    replica_id = next(iter(cp.state.replicas))

    async def go() -> None:
        async with admin_client(cp) as c:
            doc = (await c.get("/openapi.json")).json()
            routes = {
                (method, route.path.replace(":path}", "}"))
                for resource in RESOURCES
                for route in resource.routes(cp).routes
                if isinstance(route, APIRoute)
                for method in route.methods
            }
            documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
            assert routes == documented
            assert len(routes) >= 10

            called = set()
            for method, path, body, status in CALLS:
                url = path.replace("{replica}", replica_id)
                r = await c.request(method, url, content=body)
                assert r.status_code == status, f"{method} {url}: {r.status_code} {r.text}"
                template = template_of(url, doc)
                called.add((method, template))
                schema = answer_schema(doc, template, method, status)
                Draft202012Validator(schema).validate(r.json())
            assert called == routes, f"routes with no call: {routes - called}"

        # Every route refuses a wrong token, with a documented error answer; each from an
        # address of its own (an address that fails again and again waits: 429).
        for i, (method, template) in enumerate(sorted(routes)):
            url = template.replace("{replica}", replica_id).replace("{node}", "a")
            url = url.replace("{model}", "small")
            async with admin_client(cp, f"198.51.100.{i}") as guesser:
                r = await guesser.request(method, url, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401, f"{method} {url}: {r.status_code}"
            schema = answer_schema(doc, template, method, 401)
            Draft202012Validator(schema).validate(r.json())

    asyncio.run(go())


def test_a_replica_answer_carries_its_log_tail_and_the_list_does_not() -> None:
    cp = control_plane()
    [ready] = [r.replica.id for r in cp.state.replicas.values() if r.replica.shards[0].node == "a"]

    async def go() -> None:
        async with admin_client(cp) as c:
            listed = (await c.get("/v1/replicas")).json()["replicas"]
            assert {r["id"]: r["state"] for r in listed}[ready] == "ready"
            assert all(s["log_tail"] == [] for r in listed for s in r["shards"])
            one = (await c.get(f"/v1/replicas/{ready}")).json()
            assert one["shards"][0]["log_tail"] == ["loaded"]

    asyncio.run(go())


def test_a_drain_s_dry_run_says_what_would_move_and_what_cannot_and_marks_nothing() -> None:
    """Issue 41: a drain that could not place replacements was promised as "these replicas
    move elsewhere". Now it can be asked first, and the answer says which cannot move."""
    cp = control_plane()  # small's replicas: one ready on a, one on b (b's other GPU is bad)
    catalog, now = cp.catalogs.current, time.monotonic()
    for node, seq in (("b", 2), ("c", 1)):
        shards = [ShardReport.of(a, ShardState.READY, port=9001)
                  for a in cp.assignments.of(node, catalog).shards]  # fmt: skip
        gpus = SimulatedGpus("1x80GB").gpus()
        cp.state.take_report(AgentReport(node=node, boot_id="b", seq=seq, address="127.0.0.1",
                                         gpus=gpus, shards=shards), catalog, now)  # fmt: skip
    drain = {"mark": "draining", "dry_run": True}

    async def go() -> None:
        async with admin_client(cp) as c:
            answer = await c.post("/v1/nodes/a/mark", json=drain)
            asked = admin.MarkAnswer.model_validate(answer.json())
            assert asked.dry_run and cp.state.marks == {}  # nothing marked
            starts = [(s.action, s.model, [spot.node for spot in s.shards]) for s in asked.steps]
            assert ("start", "small", ["c"]) in starts
            assert all(p.model != "small" for p in asked.pending)
            await c.post("/v1/nodes/c/mark", json={"mark": "cordoned"})
            answer = await c.post("/v1/nodes/a/mark", json=drain)
            stuck = admin.MarkAnswer.model_validate(answer.json())
            assert [p.model for p in stuck.pending if p.model == "small"] == ["small"]
            assert set(cp.state.marks) == {"c"}
            shown = io.StringIO()
            bounded = stuck.model_copy(update={"drain_grace_s": 600.0})
            print_mark(bounded, Console(file=shown, width=200))
            said = " ".join(shown.getvalue().split())
            assert "node a would be draining (it is none); nothing was marked" in said
            [on_a] = cp.state.holding("a")
            assert stuck.cannot_move == [f"{on_a} (small)"]  # not wide: it is not on a
            assert f"{on_a} (small) cannot be replaced" in said
            assert "it stops after 600s anyway, and its model serves with fewer" in said

    asyncio.run(go())


def test_bad_input_gets_a_clear_4xx_and_changes_nothing() -> None:
    cp = control_plane()
    cp.config = cp.config.model_copy(update={"max_report_bytes": 1000, "insecure_agent_api": True})
    agent_app, _ = create_apps(cp)
    version = cp.catalogs.current.version

    async def go() -> None:
        async with admin_client(cp) as c:
            huge = await c.get("/v1/catalog/history?limit=99999999999999999999")
            assert huge.status_code == 400 and "limit" in huge.json()["error"]
            nan = await c.post("/v1/nodes/a/mark", content=b'{"mark": "draining", "grace_s": NaN}')
            assert nan.status_code == 400 and "grace_s" in nan.json()["error"]
            assert cp.state.marks == {}
        agents = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=agent_app), base_url="http://cp"
        )
        async with agents:
            chunks_sent = 0

            async def body() -> AsyncIterator[bytes]:
                nonlocal chunks_sent
                for _ in range(1000):
                    chunks_sent += 1
                    yield b"x" * 100

            big = await agents.post("/v1/report", content=body())
            assert big.status_code == 413
            assert chunks_sent < 20  # it stopped reading at the limit (1000 bytes)
        assert cp.catalogs.current.version == version

    asyncio.run(go())


def test_what_a_fuzzer_and_a_hand_found_gets_a_400_naming_the_field() -> None:
    """Each of these was a 500: a limit past int64 (OverflowError in SQLite), a `since` of
    99999999999999999999 weeks (the same), a catalog whose JSON holds a lone surrogate
    (pydantic could not write the refusal), a path no route matches with characters a
    route cannot hold (FastAPI's own `{"detail": ...}`, not an ErrorAnswer)."""
    cp = control_plane()

    async def go() -> None:
        async with admin_client(cp) as c:
            for limit in ("1.7e33", str(10**30)):
                huge = await c.post("/v1/keys", content=f'{{"name": "big", "rpm": {limit}}}')
                assert huge.status_code == 400 and "rpm" in huge.json()["error"], huge.text
            patched = await c.patch("/v1/keys/none", content=f'{{"tpm": {10**19}}}')
            assert patched.status_code == 400 and "tpm" in patched.json()["error"]
            for since in ("99999999999999999999w", "1" + "0" * 400 + "s"):
                far = await c.get(f"/v1/usage?since={since}")
                # Looks back 100 years, the longest a duration is (the document allows it).
                assert far.status_code == 200 and far.json()["since"] < 0, far.text
            forever = await c.post("/v1/keys", content='{"name": "f", "expires": "9999999w"}')
            assert forever.status_code == 200, forever.text  # expires in 100 years, the most
            assert (await c.delete("/v1/keys/f")).status_code == 200
            for catalog in (
                '{"models": [{"name": "x\\ud800", "engine": "sim"}]}',
                '{"models": [{"name": "x", "engine": "sim", "args": ["\\ud800"]}]}',
                '{"models": [{"name": "x", "engine": "sim", "env": {"A": "\\udfff"}}]}',
            ):
                refused = await c.put(
                    "/v1/catalog", content=catalog, headers={"content-type": "application/json"}
                )
                assert refused.status_code == 422, refused.text
                problem = refused.json()["problems"][0]
                # libyaml refuses the lone surrogate's escape where it is (line and column).
                assert "invalid Unicode character escape" in problem["message"], problem
            strange = await c.get("/v1/replicas/a%0Ab/c")
            assert strange.status_code == 404 and "no such path" in strange.json()["error"]
            wrong = await c.request("TRACE", "/v1/keys")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
            assert "error" in wrong.json()
        assert cp.catalogs.current.version == 2 and cp.store.api_keys() == []

    asyncio.run(go())


def test_a_store_that_cannot_write_refuses_changes_with_503_and_recovers_by_itself() -> None:
    """SQLite's "database or disk is full", made by capping the store at the pages it has:
    a control plane whose usage collector met it once stopped (and exited 0). Now each change
    is refused with 503 and changes nothing, collected usage waits at the router, `status`
    says why, and all of it works again once the store can write."""
    cp = control_plane()
    db = cp.store._db  # type: ignore[attr-defined]
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    rows = [{"key": "alice" * 400, "model": "small", "hour": hour * 3600, "requests": 1,
             "prompt_tokens": 2, "completion_tokens": 3, "errors": 0, "last_at": 1.0}
            for hour in range(10)]  # fmt: skip
    acks: list[bytes] = []

    def router(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/usage":
            return httpx.Response(200, json={"batches": [{"run": "r", "batch": 1, "rows": rows}]})
        acks.append(request.content)
        return httpx.Response(200, json={"ok": True})

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(router))
        collector = UsageCollector(
            [RouterTarget(url="http://router", token="t")], http, cp.calls, 1.0, time.time,
            cp.recorder,
        )  # fmt: skip
        async with admin_client(cp) as c:
            db.execute(f"PRAGMA max_page_count = {pages}")
            big = {"name": "alice", "models": ["small"] * 2000}  # each write needs new pages
            refused = await c.post("/v1/keys", json=big)
            assert refused.status_code == 503, refused.text
            assert "database or disk is full" in refused.json()["error"]
            assert refused.headers["retry-after"] == "10"
            assert (await c.get("/v1/keys")).json()["keys"] == []
            await collector.collect()  # fails to store: no acknowledgement, no exception
            assert acks == [] and cp.store.usage() == []
            status = (await c.get("/v1/status")).json()
            assert "cannot write: database or disk is full" in status["store_problem"]

            db.execute("PRAGMA max_page_count = 1000000")  # space again
            await collector.collect()
            assert len(acks) == 1 and len(cp.store.usage()) == 10
            assert (await c.post("/v1/keys", json=big)).status_code == 200
            assert (await c.get("/v1/status")).json()["store_problem"] == ""
        await http.aclose()

    asyncio.run(go())


def test_a_change_sent_again_with_its_request_id_is_made_once_and_says_what_the_first_did() -> None:
    """Issue 57: a change with an `Idempotency-Key` is made at most once; sent again, the
    answer is what the first attempt did (`Idempotent-Replayed: true`), and an id used for
    another change is refused."""
    cp = control_plane()

    def key(rid: str) -> dict[str, str]:
        return {admin.IDEMPOTENCY_KEY: rid}

    async def go() -> None:
        async with admin_client(cp) as c:
            made = await c.post("/v1/keys", json={"name": "app"}, headers=key("k-1"))
            assert made.status_code == 200 and admin.REPLAYED not in made.headers
            again = await c.post("/v1/keys", json={"name": "app"}, headers=key("k-1"))
            assert again.status_code == 409 and again.headers[admin.REPLAYED] == "true"
            assert "made by an earlier attempt" in again.json()["error"]
            other = await c.post("/v1/keys", json={"name": "app"}, headers=key("k-2"))
            assert other.status_code == 409 and admin.REPLAYED not in other.headers

            changed = await c.patch("/v1/keys/app", json={"rpm": 5}, headers=key("p-1"))
            assert changed.status_code == 200
            again = await c.patch("/v1/keys/app", json={"rpm": 7}, headers=key("p-1"))
            assert again.headers[admin.REPLAYED] == "true" and again.json()["rpm"] == 5
            assert cp.store.api_keys()[0].rpm == 5  # not made twice

            text = yaml.safe_dump({"models": [{"name": "small", "engine": "sim"}]})
            applied = (await c.put("/v1/catalog", content=text, headers=key("c-1"))).json()
            again = await c.put("/v1/catalog", content=text, headers=key("c-1"))
            assert again.headers[admin.REPLAYED] == "true"
            assert again.json()["version"] == applied["version"] and again.json()["changed"]
            history = cp.store.catalog_history(10)
            assert history[0].version == applied["version"]

            marked = await c.post("/v1/nodes/b/mark", json={"mark": "cordoned"},
                                  headers=key("m-1"))  # fmt: skip
            assert marked.status_code == 200 and marked.json()["was"] == "none"
            again = await c.post("/v1/nodes/b/mark", json={"mark": "cordoned"},
                                 headers=key("m-1"))  # fmt: skip
            assert again.headers[admin.REPLAYED] == "true" and again.json()["was"] == "none"

            revoked = await c.delete("/v1/keys/app", headers=key("r-1"))
            again = await c.delete("/v1/keys/app", headers=key("r-1"))
            assert again.status_code == 200 and again.headers[admin.REPLAYED] == "true"
            assert again.json()["name"] == revoked.json()["name"] == "app"

            reused = await c.delete("/v1/keys/app", headers=key("m-1"))
            assert (
                reused.status_code == 422
                and "was used for POST /v1/nodes/b/mark" in (reused.json()["error"])
            )
            bad = await c.post("/v1/keys", json={"name": "x"}, headers=key("no spaces"))
            assert bad.status_code == 400 and admin.IDEMPOTENCY_KEY in bad.json()["error"]

    asyncio.run(go())


def test_what_landed_after_its_answer_is_taken_from_the_store_with_its_events() -> None:
    """Issue 57: a write whose outcome stayed unknown (the connection broke as it committed)
    may have landed: the leader reads what is desired again and takes the difference into
    memory (a key the routers then get, a mark, a catalog), each with its event."""
    cp = control_plane()
    before = cp.catalogs.current.version
    cp.store.put_key(StoredKey("late", "a" * 64, "mf-late", None, None, None, None, 1.0, None))
    cp.store.set_mark(StoredMark("b", "cordoned", 1.0, None))
    cp.store.add_catalog("d", 1.0, "api", {"models": []}, "models: []\n")
    cp.calls.unsure()

    async def go() -> None:
        await cp.follow_store()

    asyncio.run(go())
    assert "late" in cp.keys.keys and [k.name for k in cp.keys.routed()] == ["late"]
    assert cp.state.marks["b"].mark.value == "cordoned"
    assert cp.catalogs.current.version == before + 1
    cp.events.flush()
    told = {(e.reason, e.regarding) for e in cp.store.events()}
    assert {("KeyCreated", "key/late"), ("NodeMarked", "node/b"),
            ("CatalogApplied", f"catalog/{before + 1}")} <= told  # fmt: skip


def test_a_mark_whose_write_answers_late_may_have_been_made_and_is_set_when_it_lands() -> None:
    """Issue 57: two cordons answered 503 "nothing was changed" showed up after the next
    failover. A mark whose store write does not answer within the deadline is answered "may
    have been made" with its request id; when the write lands, the leader sets the mark,
    says so and plans with it."""
    import threading

    cp = control_plane()
    cp.calls.deadline = 0.2
    thawed = threading.Event()
    write = cp.store.set_mark

    def frozen(mark: StoredMark, once: Any = None) -> None:
        thawed.wait(10)
        write(mark, once)

    cp.store.set_mark = frozen  # type: ignore[method-assign]

    async def go() -> None:
        async with admin_client(cp) as c:
            rid = {admin.IDEMPOTENCY_KEY: "cordon-b-1"}
            answer = await c.post("/v1/nodes/b/mark", json={"mark": "cordoned"}, headers=rid)
            said = answer.json()
            assert answer.status_code == 503 and said["may_have_been_made"], answer.text
            assert said["request_id"] == "cordon-b-1" and "nothing was changed" not in said["error"]
            assert "b" not in cp.state.marks
            again = await c.post("/v1/nodes/b/mark", json={"mark": "cordoned"}, headers=rid)
            assert again.status_code == 503 and again.json()["may_have_been_made"]  # in flight
            thawed.set()
            deadline = time.monotonic() + 10
            while "b" not in cp.state.marks:
                assert time.monotonic() < deadline, "the mark that landed was never set"
                await asyncio.sleep(0.02)
            cp.calls.outage = None  # as the next renewal would: the store answers again
            replayed = await c.post("/v1/nodes/b/mark", json={"mark": "cordoned"}, headers=rid)
            assert replayed.status_code == 200, replayed.text
            assert replayed.headers[admin.REPLAYED] == "true"

    asyncio.run(go())
    assert cp.state.marks["b"].mark.value == "cordoned"
    cp.events.flush()
    assert ("NodeMarked", "node/b") in {(e.reason, e.regarding) for e in cp.store.events()}
