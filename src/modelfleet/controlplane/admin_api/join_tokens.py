"""Join tokens: the secrets a new node joins the fleet with; and the node credentials they
were exchanged for."""

from __future__ import annotations

from fastapi import APIRouter, Request

from modelfleet.controlplane.admin_api.shared import (
    Refused,
    body_of,
    duration,
    errors,
    read_body,
)
from modelfleet.controlplane.membership import MembershipRefused, token_info
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin

MAX_TOKEN_BYTES = 16384


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/join-tokens", responses=errors())
    async def join_tokens() -> admin.JoinTokensAnswer:
        """The join tokens (never their secrets): usable, expired or used up."""
        now = cp.store_time()
        tokens = cp.membership.tokens.values()
        return admin.JoinTokensAnswer(tokens=[token_info(t, now) for t in tokens])

    @api.get("/v1/credentials", responses=errors())
    async def credentials() -> admin.CredentialsAnswer:
        """Every node credential given and not revoked (never the credential itself), whether
        its node has reported or not: one that never did is revoked by `ctl nodes revoke`."""
        return admin.CredentialsAnswer(
            credentials=[
                admin.CredentialInfo(
                    node=c.node,
                    issued_at=c.issued_at,
                    token_id=c.token_id,
                    addresses=None if c.addresses is None else list(c.addresses),
                    reported=c.node in cp.state.nodes,
                )
                for c in sorted(cp.membership.credentials.values(), key=lambda c: c.node)
            ]
        )

    @api.post(
        "/v1/join-tokens",
        responses=errors(400, 413, 503),
        openapi_extra=body_of(admin.JoinTokenCreate),
    )
    async def create_join_token(request: Request) -> admin.JoinTokenCreated:
        """Make a join token; the answer holds it, shown this once. It carries the fleet CA's
        fingerprint, for the joining agent to pin."""
        body = await read_body(request, admin.JoinTokenCreate, MAX_TOKEN_BYTES)
        ttl: float | None = None
        if body.ttl.strip() != "never":
            ttl = duration("ttl", body.ttl, "; or 'never'", clamp=True)
            if ttl <= 0:
                raise Refused.because(400, f"ttl: {body.ttl!r} is no time at all")
        now = cp.store_time()
        try:
            token, stored = await cp.membership.create_token(ttl, body.uses, now, body.addresses)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        info = token_info(stored, now).model_dump()
        return admin.JoinTokenCreated(token=str(token), ca_fingerprint=token.ca_fingerprint, **info)

    @api.delete("/v1/join-tokens/{token_id}", responses=errors(404, 503))
    async def revoke_join_token(token_id: str) -> admin.JoinTokenInfo:
        """Delete a join token: no node joins with it after this (those that did stay)."""
        try:
            stored = await cp.membership.revoke_token(token_id)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return token_info(stored, cp.store_time())

    return api
