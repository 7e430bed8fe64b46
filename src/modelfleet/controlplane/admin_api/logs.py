"""An engine's output, read by its node's agent on demand."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from modelfleet.controlplane.admin_api.shared import Refused, Since, duration, errors
from modelfleet.controlplane.logs import LogUnanswered
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin

LOG_WAIT_S = 15.0  # for an agent to answer a log request: its heartbeat is held, or comes


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/logs/{replica}", responses=errors(404, 504))
    async def logs(
        replica: str,
        shard: Annotated[int, Query(ge=0)] = 0,
        tail: Annotated[int, Query(ge=1, le=100_000)] = 200,
        previous: Annotated[int, Query(ge=0, le=100)] = 0,
        offset: Annotated[int | None, Query(ge=0)] = None,
        since: Annotated[str | None, Since] = None,
        run: Annotated[str | None, Query(max_length=64)] = None,
    ) -> admin.LogsAnswer:
        """An engine's output, read by its node's agent on demand: the last `tail` lines
        (of those written in the last `since`, a duration: 10m, 1h), or with `offset` what
        was written from there on (a follow: with the `run` the last answer named, it goes
        on across the engine's restarts: the rest of that run, then the new one);
        `previous`: that many runs back (before restarts). Also of a replica stopped lately
        (the last 1,000)."""
        since_s = None if since is None else duration("since", since, clamp=True)
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
                node, replica, shard, previous, tail, offset, LOG_WAIT_S, since_s, run
            )
        except LogUnanswered as exc:
            raise Refused.because(504, str(exc)) from None
        if got.error:
            raise Refused.because(404, f"{node}: {got.error}")
        return admin.LogsAnswer(
            replica=replica, shard=shard, node=node, previous=previous, lines=got.lines,
            offset=got.offset, run=got.run,
        )  # fmt: skip

    return api
