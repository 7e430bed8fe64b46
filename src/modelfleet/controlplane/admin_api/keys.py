"""Client API keys: list (with what each used), make, change, revoke."""

from __future__ import annotations

from fastapi import APIRouter, Request

from modelfleet.controlplane import keys
from modelfleet.controlplane.admin_api.shared import Refused, body_of, errors, read_body
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin

MAX_KEY_BYTES = 16384


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
        "/v1/keys", responses=errors(400, 409, 413, 503), openapi_extra=body_of(admin.KeyCreate)
    )
    async def create_key(request: Request) -> admin.KeyCreated:
        """Make a client API key; the answer holds the key, shown this once. Every router
        takes it with its next routing table."""
        body = await read_body(request, admin.KeyCreate, MAX_KEY_BYTES)
        try:
            key, stored = await cp.create_key(body)
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return admin.KeyCreated(key=key, **keys.info(stored).model_dump())

    @api.patch(
        "/v1/keys/{name}",
        responses=errors(400, 404, 409, 413, 503),
        openapi_extra=body_of(admin.KeyUpdate),
    )
    async def update_key(name: str, request: Request) -> admin.KeyInfo:
        """Change a key's models, limits or expiry."""
        body = await read_body(request, admin.KeyUpdate, MAX_KEY_BYTES)
        names = keys.key_names(cp.catalogs.current)
        try:
            stored = await cp.keys.update(name, body, names, cp.store_time())
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        changed = ", ".join(sorted(body.model_dump(exclude_unset=True))) or "nothing"
        cp.events.normal("KeyUpdated", f"key/{name}", f"changed: {changed}")
        cp.wake()
        return keys.info(stored)

    @api.delete("/v1/keys/{name}", responses=errors(404, 503))
    async def revoke_key(name: str) -> admin.KeyInfo:
        """Revoke a key: every router refuses it once it holds the next routing table."""
        try:
            stored = await cp.keys.revoke(name)
        except keys.KeyRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        cp.events.normal("KeyRevoked", f"key/{name}", "revoked: every router refuses it next")
        cp.wake()
        return keys.info(stored)

    return api
