"""What the keys used: requests, tokens and errors per key, model and hour."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from modelfleet.controlplane.admin_api.shared import Since, duration, errors
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/usage", responses=errors(400))
    async def usage(
        key: str | None = None,
        model: str | None = None,
        since: Annotated[str, Since] = "24h",
    ) -> admin.UsageAnswer:
        """Requests, prompt and completion tokens and errors per key, model and hour, from
        the hour `since` ago (a duration: 90m, 24h, 7d) on."""
        start = int((cp.clock.time() - duration("since", since, clamp=True)) // 3600) * 3600
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

    return api
