"""The admin API: what operators (and `ctl`) read and change, behind the admin token.

Every request and answer is a model of `modelfleet.admin`; the document at `/openapi.json`
describes them all. Every error answer is an `ErrorAnswer` (`{"error": ...}`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from modelfleet import admin
from modelfleet.catalog import Catalog, CatalogInvalid
from modelfleet.controlplane import keys, views
from modelfleet.controlplane.catalogs import API_SOURCE
from modelfleet.controlplane.logs import LogUnanswered
from modelfleet.controlplane.membership import MembershipRefused, token_info
from modelfleet.controlplane.plane import ControlPlane, MarkRefused, NodeBusy
from modelfleet.fleet import Mark
from modelfleet.store import StoreError
from modelfleet.units import BadDuration, parse_duration
from modelfleet.web import JSON, bearer_matches, read_at_most


class Refused(Exception):
    """An admin request refused: the status and the `ErrorAnswer` sent back."""

    def __init__(self, status: int, answer: admin.ErrorAnswer) -> None:
        super().__init__(answer.error)
        self.status = status
        self.answer = answer

    @classmethod
    def because(cls, status: int, message: str) -> Refused:
        return cls(status, admin.ErrorAnswer(error=message))


# Reads of what runs, which only the leader learns (from agents' reports): a follower
# redirects them to the leader. Everything else is read from the store, by any control plane.
LIVE_STATE = ("/v1/nodes", "/v1/replicas", "/v1/explain/", "/v1/routing", "/v1/logs/")


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": admin.ErrorAnswer} for status in (401, *statuses)}


_CATALOG_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/yaml": {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}},
        },
        "description": "A catalog file: `models:` and a list of models (YAML or JSON).",
    }
}


def _body_of(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


_MARK_BODY = _body_of(admin.MarkRequest)
LOG_WAIT_S = 15.0  # for an agent to answer a log request: its heartbeat is held, or comes
KeyRequest = TypeVar("KeyRequest", admin.KeyCreate, admin.KeyUpdate, admin.JoinTokenCreate)


def _error(
    status: int, answer: admin.ErrorAnswer, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer. Encoded by the json module, which writes what it echoes of the
    request (a lone surrogate in a catalog, say) as escapes where pydantic's encoder fails."""
    body = json.dumps(answer.model_dump(exclude_none=True))
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def _no_such_model(catalog: Catalog, model: str) -> Refused:
    known = ", ".join(m.name for m in catalog.models) or "none"
    return Refused.because(404, f"model {model!r} is not in the current catalog (models: {known})")


def _problems(errors: Sequence[Mapping[str, Any]]) -> str:
    """pydantic's errors in one line: `field: what is wrong; ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors)


def create_admin_app(cp: ControlPlane) -> FastAPI:
    """The admin API of `cp`."""

    async def authorized(request: Request) -> None:
        if not bearer_matches(request.headers.get("authorization"), cp.config.admin_token):
            raise Refused.because(401, "missing or wrong admin token")

    app = FastAPI(
        title="modelfleet admin API",
        version="1",
        description="Nodes, replicas, placement, marks, the catalog and the client API keys of "
        "a modelfleet fleet. "
        "Send the admin token as `Authorization: Bearer TOKEN`.",
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(authorized)],
    )

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> Response:
        return _error(exc.status, exc.answer)

    @app.middleware("http")
    async def only_the_leader_writes(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """A change made through a follower would race the leader's: redirected to the leader
        (307, the same method and body), or refused naming it while it has not said where it
        is reached, and for the dashboard (its sign-in cookie is this origin's). Reads of
        what runs (LIVE_STATE) are redirected to the leader too."""
        path = request.url.path
        reading = request.method in READ_METHODS
        if cp.acting():
            return await call_next(request)
        if reading and not path.startswith(LIVE_STATE):
            # A follower answers what the store holds now. While the store cannot be read,
            # nobody can change it either: what this one read last is answered. Status
            # reads nothing of it, and answers at once whatever the store does.
            if path != "/v1/status":
                with contextlib.suppress(StoreError):
                    await cp.read_desired()
            return await call_next(request)
        if path in ("/ui/login", "/ui/logout"):
            return await call_next(request)
        url = cp.leadership.leader_url("admin")
        if url is not None and not path.startswith("/ui/"):
            location = url.rstrip("/") + path
            if request.url.query:
                location += "?" + request.url.query
            why = "what runs is the leader's" if reading else f"the leader is {url}"
            said = admin.ErrorAnswer(error=f"this control plane follows; {why}")
            return _error(307, said, {"location": location})
        if reading:  # what runs, with no leader to ask: this one's own (empty) view
            return await call_next(request)
        store = cp.calls.problem() if cp.calls.outage is not None else cp.leadership.problem
        if store:  # it cannot renew its lease: nobody can change anything now
            why = f"this control plane cannot take changes now: {store}"
            return _error(503, admin.ErrorAnswer(error=why), {"retry-after": "1"})
        leader = cp.leadership.leader or "none yet"
        answer = admin.ErrorAnswer(
            error=f"this control plane follows (the leader is {leader}"
            + (f" at {url}" if url else "")
            + "); send changes to the leader"
        )
        return _error(503, answer, {"retry-after": "1"})

    async def metrics(request: Request) -> Response:
        """The control plane's Prometheus metrics (`controlplane/metrics.py`): the admin token
        or the metrics token. A plain route, out of the API's document: its answer is text."""
        given = request.headers.get("authorization")
        tokens = (cp.config.admin_token, cp.config.metrics_token)
        if not any(bearer_matches(given, token) for token in tokens):
            return _error(401, admin.ErrorAnswer(error="missing or wrong admin or metrics token"))
        return Response(generate_latest(cp.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_route("/metrics", metrics, methods=["GET"])

    @app.exception_handler(StoreError)
    async def cannot_write(_: Request, exc: StoreError) -> Response:
        """A change the store could not record (a full disk): nothing was changed."""
        message = (
            f"{exc}; nothing was changed. The control plane goes on serving and recovers by "
            "itself once its store can write again: try again then"
        )
        return _error(503, admin.ErrorAnswer(error=message), {"retry-after": "10"})

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, exc: RequestValidationError) -> Response:
        problems = _problems([{**e, "loc": e["loc"][1:]} for e in exc.errors()])
        return _error(400, admin.ErrorAnswer(error=f"malformed request: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, exc: StarletteHTTPException) -> Response:
        """A path no route matches, or a method it does not take, as an `ErrorAnswer`."""
        what = {404: "no such path", 405: "method not allowed on"}.get(exc.status_code, "")
        message = f"{what} {request.method} {request.url.path}" if what else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            # Each method of a path is a route of its own: Allow names those of all of them.
            methods = {
                method
                for route in app.routes
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE
                for method in route.methods or ()
            }
            headers = {"allow": ", ".join(sorted(methods))}
        return _error(exc.status_code, admin.ErrorAnswer(error=message), headers)

    @app.get("/v1/nodes", responses=_errors())
    async def nodes() -> admin.NodesAnswer:
        """The nodes, their GPUs and health, marks and what runs on them."""
        return views.nodes(cp.state, cp.clock.monotonic(), cp.frozen)

    @app.post(
        "/v1/nodes/{node}/mark", responses=_errors(400, 404, 413, 503), openapi_extra=_MARK_BODY
    )
    async def mark_node(node: str, request: Request) -> admin.MarkAnswer:
        """Cordon, drain or uncordon a node, and say what moves because of it."""
        # The body is read as JSON whatever its Content-Type says: `curl -d` sends a form type.
        raw = await read_at_most(request, 4096)
        if raw is None:
            raise Refused.because(413, "a mark request may have at most 4096 bytes")
        try:
            body = admin.MarkRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise Refused.because(400, f"malformed request: {_problems(exc.errors())}") from None
        grace = cp.config.drain_grace if body.grace_s is None else body.grace_s
        if body.dry_run:
            if node not in cp.state.nodes:
                raise Refused.because(404, f"no node {node!r}")
            mark = cp.state.marks.get(node)
            was = mark.mark if mark is not None else Mark.NONE
            preview = await cp.preview(cp.catalogs.current, {node: Mark(body.mark)})
        else:
            try:
                was = await cp.mark_node(node, Mark(body.mark), body.grace_s)
            except MarkRefused as exc:
                raise Refused.because(exc.status, str(exc)) from None
            preview = await cp.preview(cp.catalogs.current)
        moves, pending = views.steps(preview)
        draining = body.mark == Mark.DRAINING.value and grace > 0
        cannot_move = []
        if body.mark == Mark.DRAINING.value:
            stuck = {p.model for p in pending}
            for rid in cp.state.holding(node):
                model = cp.state.replicas[rid].replica.model
                if model in stuck:
                    cannot_move.append(f"{rid} ({model})")
        return admin.MarkAnswer(
            node=node,
            mark=body.mark,
            was=was.value,
            drain_grace_s=grace if draining else None,
            steps=moves,
            pending=pending,
            dry_run=body.dry_run,
            cannot_move=cannot_move,
        )

    @app.delete("/v1/nodes/{node}", responses=_errors(404, 409, 503))
    async def delete_node(node: str, force: bool = False) -> admin.NodeDeleted:
        """Forget a node. Refused while replicas run on it, unless `force`: then they are
        placed anew elsewhere at once. An agent that reports again comes back as a new node."""
        if node not in cp.state.nodes:
            known = ", ".join(sorted(cp.state.nodes)) or "none has reported yet"
            raise Refused.because(404, f"no node {node!r} has reported (nodes: {known})")
        try:
            retired = await cp.delete_node(node, force)
        except NodeBusy as exc:
            raise Refused.because(409, str(exc)) from None
        return admin.NodeDeleted(node=node, retired=retired)

    @app.get("/v1/replicas", responses=_errors())
    async def replicas() -> admin.ReplicasAnswer:
        """The replicas, their shards and state, and what is pending and why."""
        ejections = cp.loads.ejections(cp.clock.monotonic())
        return views.replicas(cp.state, cp.catalogs.current, cp.autoscaler, ejections)

    @app.get("/v1/replicas/{replica:path}", responses=_errors(404))
    async def replica(replica: str) -> admin.ReplicaInfo:
        """One replica with every shard's state, error, restarts, backoff and log tail."""
        record = cp.state.replicas.get(replica)
        if record is None:
            retired = cp.state.retired.get(replica)
            if retired is not None:
                raise Refused.because(404, f"replica {replica!r} was stopped: {retired[0]}")
            known = ", ".join(sorted(cp.state.replicas)) or "none"
            raise Refused.because(404, f"no replica {replica!r} (replicas: {known})")
        ejected = cp.loads.ejections(cp.clock.monotonic()).get(replica, [])
        return views.replica_view(cp.state, record, ejected)

    @app.get("/v1/explain/{model:path}", responses=_errors(404))
    async def explain(model: str) -> admin.Explanation:
        """Where the model's next replica would go, or every node and why not."""
        catalog = cp.catalogs.current
        answer = views.explanation(cp.state, catalog, model, cp.clock.monotonic())
        if answer is None:
            raise _no_such_model(catalog, model)
        return answer

    @app.post("/v1/rebalance", responses=_errors(404, 503))
    async def rebalance(model: str | None = None, dry_run: bool = False) -> admin.RebalanceAnswer:
        """Even out spread models (one, or all) over the nodes that can host them: while a
        node holds two replicas of a model more than another with room, the newest moves
        there, make-before-break and `max_parallel` at a time. With `dry_run`, only say what
        would move."""
        catalog = cp.catalogs.current
        if model is not None and catalog.get(model) is None:
            raise _no_such_model(catalog, model)
        moves = cp.rebalance(model, dry_run)
        return admin.RebalanceAnswer(
            dry_run=dry_run,
            moves=[
                admin.MoveInfo(
                    replica=m.replica_id,
                    model=m.model,
                    from_node=m.from_node,
                    to_node=m.to_node,
                    reason=m.reason,
                )
                for m in moves
            ],
        )

    @app.get("/v1/catalog", responses=_errors())
    async def catalog() -> admin.CatalogAnswer:
        """The current catalog, its version, and the last rejected attempt."""
        return views.catalog(cp.catalogs)

    @app.get("/v1/catalog/history", responses=_errors(400))
    async def catalog_history(
        limit: Annotated[int, Query(ge=1, le=admin.MAX_HISTORY)] = 20,
    ) -> admin.CatalogHistory:
        """The last applied catalog versions, newest first."""
        return views.history(await cp.calls(cp.catalogs.history, limit))

    @app.put("/v1/catalog", responses=_errors(400, 413, 422, 503), openapi_extra=_CATALOG_BODY)
    async def put_catalog(request: Request, dry_run: bool = False) -> admin.CatalogChange:
        """Apply the catalog in the body, or with `dry_run` only say what applying it would
        do. An invalid catalog changes nothing and gets 422 with every problem."""
        limit = cp.config.max_catalog_bytes
        body = await read_at_most(request, limit)
        if body is None:
            raise Refused.because(413, f"a catalog may have at most {limit} bytes")
        text = body.decode(errors="replace")
        current = cp.catalogs.current
        try:
            if dry_run:
                candidate = cp.catalogs.validate(text, API_SOURCE)
                demand = cp.term.adapter_demand(candidate)
                adapters = views.adapter_changes(cp.state, candidate, demand, cp.replica_loads())
                moves, pending = views.steps(await cp.preview(candidate))
                return admin.CatalogChange(
                    dry_run=True,
                    changed=candidate.digest != current.digest,
                    version=current.version,
                    steps=moves,
                    pending=pending,
                    adapters=adapters,
                )
            applied = await cp.calls(cp.catalogs.apply, text, API_SOURCE, cp.clock.time())
        except CatalogInvalid as exc:
            if not dry_run:
                cp.catalog_refused([str(p) for p in exc.problems], API_SOURCE)
            raise Refused(422, views.refused(exc)) from None
        cp.catalog_event(applied, API_SOURCE)
        if applied.changed:
            cp.wake()
        # The preview takes the table before anything is awaited: what the next passes do.
        demand = cp.term.adapter_demand(applied.catalog)
        adapters = views.adapter_changes(cp.state, applied.catalog, demand, cp.replica_loads())
        moves, pending = views.steps(await cp.preview(applied.catalog))
        return admin.CatalogChange(
            dry_run=False,
            changed=applied.changed,
            version=applied.catalog.version,
            previous_version=applied.previous.version,
            digest=applied.catalog.digest,
            steps=moves,
            pending=pending,
            adapters=adapters,
        )

    @app.get("/v1/status", responses=_errors())
    async def status() -> admin.StatusAnswer:
        """Whether the control plane is settling, how many passes it made, what is current."""
        state = cp.state
        return admin.StatusAnswer(
            settling=cp.settling(cp.clock.monotonic()),
            reconcile_passes=cp.passes,
            reconcile_plans=cp.plans,
            last_plan_ms=_ms(cp.last_plan_s),
            last_idle_pass_ms=_ms(cp.last_idle_pass_s),
            heartbeat_interval=cp.config.heartbeats(len(state.nodes)).interval,
            catalog_version=cp.catalogs.current.version,
            routing_epoch=cp.publisher.epoch,
            routing_version=cp.publisher.version,
            nodes=len(state.nodes),
            replicas=len(state.replicas),
            pending=sum(p.count for p in state.pending),
            frozen=cp.frozen,
            store_problem=cp.calls.problem() or cp.leadership.problem,
            store=cp.store.where,
            leading=cp.acting(),
            leader=cp.leadership.leader,
            lease_epoch=cp.leadership.epoch,
            control_planes=_control_planes(cp),
            scaling=views.scaling(cp.autoscaler, cp.catalogs.current),
        )

    @app.get("/v1/routing", responses=_errors())
    async def routing() -> admin.RoutingAnswer:
        """The routing table last pushed to the routers, and what each confirmed."""
        return cp.publisher.answer()

    async def key_body(request: Request, model: type[KeyRequest]) -> KeyRequest:
        # Read as JSON whatever its Content-Type says, as a mark request is.
        raw = await read_at_most(request, 16384)
        if raw is None:
            raise Refused.because(413, "a request may have at most 16384 bytes")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise Refused.because(400, f"malformed request: {_problems(exc.errors())}") from None

    def model_names() -> list[str]:
        return [m.name for m in cp.catalogs.current.models]

    @app.get("/v1/keys", responses=_errors())
    async def list_keys() -> admin.KeysAnswer:
        """The client API keys this control plane manages (never the keys themselves)."""
        used = await cp.usage_totals()
        return admin.KeysAnswer(
            keys=[keys.info(k, used.get(name)) for name, k in sorted(cp.keys.keys.items())]
        )

    @app.get("/v1/usage", responses=_errors(400))
    async def usage(
        key: str | None = None, model: str | None = None, since: str = "24h"
    ) -> admin.UsageAnswer:
        """Requests, prompt and completion tokens and errors per key, model and hour, from
        the hour `since` ago (a duration: 90m, 24h, 7d) on."""
        try:
            back = parse_duration(since)
        except BadDuration as exc:
            raise Refused.because(400, f"since: {exc}") from None
        start = int((cp.clock.time() - back) // 3600) * 3600
        rows = await cp.calls(cp.store.usage, key, model, start)
        return admin.UsageAnswer(
            since=start,
            usage=[
                admin.UsageInfo(
                    key=u.key,
                    model=u.model,
                    hour=u.hour,
                    requests=u.requests,
                    prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                    errors=u.errors,
                )
                for u in rows
            ],
        )

    @app.post(
        "/v1/keys", responses=_errors(400, 409, 413, 503), openapi_extra=_body_of(admin.KeyCreate)
    )
    async def create_key(request: Request) -> admin.KeyCreated:
        """Make a client API key; the answer holds the key, shown this once. Every router
        takes it with its next routing table."""
        body = await key_body(request, admin.KeyCreate)
        try:
            key, stored = await cp.create_key(body)
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return admin.KeyCreated(key=key, **keys.info(stored).model_dump())

    @app.patch(
        "/v1/keys/{name}",
        responses=_errors(400, 404, 413, 503),
        openapi_extra=_body_of(admin.KeyUpdate),
    )
    async def update_key(name: str, request: Request) -> admin.KeyInfo:
        """Change a key's models, limits or expiry."""
        body = await key_body(request, admin.KeyUpdate)
        try:
            stored = await cp.keys.update(name, body, model_names(), cp.store_time())
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        changed = ", ".join(sorted(body.model_dump(exclude_unset=True))) or "nothing"
        cp.events.normal("KeyUpdated", f"key/{name}", f"changed: {changed}")
        cp.wake()
        return keys.info(stored)

    @app.delete("/v1/keys/{name}", responses=_errors(404, 503))
    async def revoke_key(name: str) -> admin.KeyInfo:
        """Revoke a key: every router refuses it once it holds the next routing table."""
        try:
            stored = await cp.keys.revoke(name)
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        cp.events.normal("KeyRevoked", f"key/{name}", "revoked: every router refuses it next")
        cp.wake()
        return keys.info(stored)

    @app.post("/v1/nodes/{node}/revoke", responses=_errors(404, 409, 503))
    async def revoke_node(node: str) -> admin.NodeRevoked:
        """Cut a node off at once: its credential is deleted (nothing it sends is taken), and
        its replicas are replaced elsewhere as a lost node's are. It comes back only by
        joining anew with a join token."""
        try:
            replacing = await cp.revoke_node(node)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return admin.NodeRevoked(node=node, replacing=replacing)

    @app.get("/v1/join-tokens", responses=_errors())
    async def join_tokens() -> admin.JoinTokensAnswer:
        """The join tokens (never their secrets): usable, expired or used up."""
        now = cp.store_time()
        tokens = cp.membership.tokens.values()
        return admin.JoinTokensAnswer(tokens=[token_info(t, now) for t in tokens])

    @app.post(
        "/v1/join-tokens",
        responses=_errors(400, 413, 503),
        openapi_extra=_body_of(admin.JoinTokenCreate),
    )
    async def create_join_token(request: Request) -> admin.JoinTokenCreated:
        """Make a join token; the answer holds it, shown this once. It carries the fleet CA's
        fingerprint, for the joining agent to pin."""
        body = await key_body(request, admin.JoinTokenCreate)
        ttl: float | None = None
        if body.ttl != "never":
            try:
                ttl = parse_duration(body.ttl)
            except BadDuration as exc:
                raise Refused.because(400, f"ttl: {exc}; or 'never'") from None
            if ttl <= 0:
                raise Refused.because(400, f"ttl: {body.ttl!r} is no time at all")
        now = cp.store_time()
        try:
            token, stored = await cp.membership.create_token(ttl, body.uses, now)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        info = token_info(stored, now).model_dump()
        return admin.JoinTokenCreated(token=str(token), ca_fingerprint=token.ca_fingerprint, **info)

    @app.delete("/v1/join-tokens/{token_id}", responses=_errors(404, 503))
    async def revoke_join_token(token_id: str) -> admin.JoinTokenInfo:
        """Delete a join token: no node joins with it after this (those that did stay)."""
        try:
            stored = await cp.membership.revoke_token(token_id)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return token_info(stored, cp.store_time())

    @app.get("/v1/logs/{replica}", responses=_errors(404, 504))
    async def logs(
        replica: str,
        shard: Annotated[int, Query(ge=0)] = 0,
        tail: Annotated[int, Query(ge=1, le=100_000)] = 200,
        previous: Annotated[int, Query(ge=0, le=100)] = 0,
        offset: Annotated[int | None, Query(ge=0)] = None,
        since: str | None = None,
    ) -> admin.LogsAnswer:
        """An engine's output, read by its node's agent on demand: the last `tail` lines
        (of those written in the last `since`, a duration: 10m, 1h), or with `offset` what
        was written from there on (a follow); `previous`: that many runs back (before
        restarts). Also of a replica stopped lately (the last 1,000)."""
        since_s = None
        if since is not None:
            try:
                since_s = parse_duration(since)
            except BadDuration as exc:
                raise Refused.because(400, f"since: {exc}") from None
        record = cp.state.replicas.get(replica)
        nodes = (
            tuple(p.node for p in record.replica.shards)
            if record is not None
            else cp.state.dropped.get(replica)  # stopped: its logs stay on its nodes
        )
        if nodes is None:
            raise Refused.because(404, f"no replica {replica!r} (`ctl replicas` lists them)")
        if shard >= len(nodes):
            raise Refused.because(404, f"replica {replica} has {len(nodes)} shard(s)")
        node = nodes[shard]
        try:
            got = await cp.logs.ask(
                node, replica, shard, previous, tail, offset, LOG_WAIT_S, since_s
            )
        except LogUnanswered as exc:
            raise Refused.because(504, str(exc)) from None
        if got.error:
            raise Refused.because(404, f"{node}: {got.error}")
        return admin.LogsAnswer(
            replica=replica, shard=shard, node=node, previous=previous, lines=got.lines,
            offset=got.offset,
        )  # fmt: skip

    @app.get("/v1/events", responses=_errors(400))
    async def events(
        regarding: Annotated[
            str | None,
            Query(
                alias="for",
                description="One object (node/NAME, model/NAME, replica/ID, key/NAME) or kind.",
                max_length=300,
            ),
        ] = None,
        since: str = "1h",
        after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> admin.EventsAnswer:
        """What happened, oldest first: events last seen from `since` ago (a duration: 10m,
        1h, 7d) on, with an id above `after` (for a watch), at most `limit` (the newest)."""
        try:
            back = parse_duration(since)
        except BadDuration as exc:
            raise Refused.because(400, f"since: {exc}") from None
        rows = await cp.calls(cp.read_events, regarding, cp.clock.time() - back, after, limit)
        return admin.EventsAnswer(
            events=[
                admin.EventInfo(
                    id=e.id, type=e.type, reason=e.reason, regarding=e.regarding,
                    message=e.message, count=e.count, first_at=e.first_at, last_at=e.last_at,
                    source=e.source,
                )
                for e in rows
            ]
        )  # fmt: skip

    def document() -> dict[str, Any]:
        """FastAPI's document, saying what this API answers to a malformed request: 400 with
        an ErrorAnswer (see `malformed`), not FastAPI's own 422."""
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            error = {"$ref": "#/components/schemas/ErrorAnswer"}
            for operations in doc["paths"].values():
                for operation in operations.values():
                    answers = operation["responses"]
                    default = answers.get("422", {}).get("content", {}).get("application/json")
                    if default and default["schema"]["$ref"].endswith("/HTTPValidationError"):
                        del answers["422"]
                        answers["400"] = {
                            "description": "Malformed request",
                            "content": {"application/json": {"schema": error}},
                        }
            for unused in ("HTTPValidationError", "ValidationError"):
                doc["components"]["schemas"].pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
    return app


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _control_planes(cp: ControlPlane) -> list[admin.ControlPlaneInfo]:
    """Every control plane on the store, as the last lease renewal read them (no store call:
    status answers at once whatever the store does), seen that much longer ago since."""
    leadership = cp.leadership
    since = max(0.0, cp.clock.monotonic() - leadership.planes_read_at)
    return [
        admin.ControlPlaneInfo(
            name=p.name,
            agent_url=p.agent_url,
            admin_url=p.admin_url,
            seen_ago_s=round(max(0.0, p.seen_ago_s + since), 3),
            leads=p.name == leadership.leader,
            answering=p.name == leadership.holder,
        )
        for p in leadership.planes
    ]
