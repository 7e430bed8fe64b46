"""What happened: the events, for a watch or a look back."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from modelfleet.controlplane.admin_api.shared import Since, duration, errors
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/events", responses=errors(400))
    async def events(
        regarding: Annotated[
            str | None,
            Query(
                alias="for",
                description="One object (node/NAME, model/NAME, replica/ID, key/NAME) or kind.",
                max_length=300,
            ),
        ] = None,
        since: Annotated[str, Since] = "1h",
        after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> admin.EventsAnswer:
        """What happened, by when it was last seen (the latest last): events last seen from
        `since` ago (a duration: 10m, 1h, 7d) on, with an id above `after`, at most `limit`
        (the last seen). For model/NAME, its replicas' events too; for node/NAME, those of
        the shards on it."""
        start = cp.clock.time() - duration("since", since, clamp=True)
        rows = await cp.calls(cp.read_events, regarding, start, after, limit)
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

    return api
