"""Client API keys: list (with what each used), make, change, revoke."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from modelfleet.controlplane import keys
from modelfleet.controlplane.admin_api import once
from modelfleet.controlplane.admin_api.shared import Refused, body_of, errors, read_body
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin
from modelfleet.store import AlreadyMade, StoredKey, StoredRequest

MAX_KEY_BYTES = 16384
CREATE = "POST /v1/keys"


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/keys", responses=errors())
    async def list_keys() -> admin.KeysAnswer:
        """The client API keys this control plane manages (never the keys themselves)."""
        used = await cp.usage_totals()
        return admin.KeysAnswer(
            keys=[keys.info(k, used.get(name)) for name, k in sorted(cp.keys.keys.items())]
        )

    @api.post(
        "/v1/keys",
        responses=errors(400, 409, 413, 503),
        openapi_extra=body_of(admin.KeyCreate),
        response_model=admin.KeyCreated,
    )
    async def create_key(request: Request) -> admin.KeyCreated | Response:
        """Make a client API key; the answer holds the key, shown this once. Every router
        takes it with its next routing table. Made at most once per `Idempotency-Key`: the
        key of one made before is not shown again (409; it is kept hashed only)."""
        body = await read_body(request, admin.KeyCreate, MAX_KEY_BYTES)
        try:
            try:
                key, stored = await cp.create_key(body, once.begin(cp, request, CREATE))
            except keys.KeyRefused as exc:  # a key of its name made by an earlier attempt?
                if exc.status != 409 or (made := await once.earlier(cp, request)) is None:
                    raise
                raise AlreadyMade(made) from None
        except AlreadyMade as exc:
            made = exc.request
            return once.refused_replay(
                CREATE,
                made,
                409,
                f"key {body.name!r} was made by an earlier attempt of this "
                f"request ({made.id}); its secret was in that attempt's answer only and is "
                "kept nowhere: if that answer was lost, revoke the key (`modelfleet ctl keys "
                "revoke NAME`) and make another",
            )
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return admin.KeyCreated(key=key, **keys.info(stored).model_dump())

    @api.patch(
        "/v1/keys/{name}",
        responses=errors(400, 404, 409, 413, 503),
        openapi_extra=body_of(admin.KeyUpdate),
        response_model=admin.KeyInfo,
    )
    async def update_key(name: str, request: Request) -> admin.KeyInfo | Response:
        """Change a key's models, limits or expiry. Made at most once per
        `Idempotency-Key`."""
        body = await read_body(request, admin.KeyUpdate, MAX_KEY_BYTES)
        names = keys.key_names(cp.catalogs.current)
        changed = ", ".join(sorted(body.model_dump(exclude_unset=True))) or "nothing"

        def updated(_: StoredKey) -> None:
            cp.events.normal("KeyUpdated", f"key/{name}", f"changed: {changed}")
            cp.wake()

        route = f"PATCH /v1/keys/{name}"
        try:
            note = once.begin(cp, request, route)
            stored = await cp.keys.update(name, body, names, cp.store_time(), note, updated)
        except AlreadyMade as exc:
            return made_before(route, name, exc.request)
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return keys.info(stored)

    @api.delete("/v1/keys/{name}", responses=errors(404, 503), response_model=admin.KeyInfo)
    async def revoke_key(name: str, request: Request) -> admin.KeyInfo | Response:
        """Revoke a key: every router refuses it once it holds the next routing table. Made
        at most once per `Idempotency-Key`."""

        def revoked(_: StoredKey) -> None:
            cp.events.normal("KeyRevoked", f"key/{name}", "revoked: every router refuses it next")
            cp.wake()

        route = f"DELETE /v1/keys/{name}"
        try:
            old = cp.keys.keys.get(name)
            info = keys.info(old).model_dump(mode="json") if old is not None else {}
            stored = await cp.keys.revoke(name, once.begin(cp, request, route, **info), revoked)
        except AlreadyMade as exc:
            return made_before(route, name, exc.request)
        except keys.KeyRefused as exc:  # no such key: revoked by an earlier attempt?
            if exc.status == 404 and (made := await once.earlier(cp, request)) is not None:
                return made_before(route, name, made)
            raise Refused.because(exc.status, str(exc)) from None
        return keys.info(stored)

    def made_before(route: str, name: str, made: StoredRequest) -> Response:
        """A key changed or revoked by an earlier attempt of the request: the key as it is
        now (a change), or as it was when revoked."""
        once.same_route(route, made)
        if route.startswith("DELETE") and made.outcome:
            return once.replayed(route, made, admin.KeyInfo.model_validate(made.outcome))
        current = cp.keys.keys.get(name)
        if route.startswith("PATCH") and current is not None:
            return once.replayed(route, made, keys.info(current))
        message = f"{route} was made by an earlier attempt of this request ({made.id})"
        return once.refused_replay(route, made, 409, message)

    return api
