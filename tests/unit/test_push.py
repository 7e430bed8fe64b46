"""The push API (`router/push.py`), written once for a router and for the parent of its
workers: checked here against a target that answers as either would, failures included."""

from __future__ import annotations

import asyncio

import httpx

from modelfleet.messages.wire import RoutingAck, RoutingSnapshot, UsageAck, UsageReport
from modelfleet.router.push import PushUnavailable, create_push_app


class Target:
    def __init__(self) -> None:
        self.version = 3
        self.unavailable = False
        self.acked: list[UsageAck] = []

    async def take_table(self, snapshot: RoutingSnapshot, body: bytes) -> RoutingAck:
        if self.unavailable:
            raise PushUnavailable("router worker 1 is starting")
        applied = snapshot.version >= self.version
        self.version = max(self.version, snapshot.version)
        return RoutingAck(applied=applied, epoch=1, version=self.version)

    async def held(self) -> RoutingAck:
        if self.unavailable:
            raise PushUnavailable("router worker 1 did not answer")
        return RoutingAck(applied=True, epoch=1, version=self.version)

    async def shown_table(self) -> bytes:
        return b'{"version": 3}'

    async def usage(self) -> UsageReport:
        return UsageReport()

    async def ack_usage(self, ack: UsageAck) -> None:
        self.acked.append(ack)


def test_each_call_is_checked_once_for_every_kind_of_target() -> None:
    target = Target()
    app = create_push_app(target, "push-token")

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://push") as c:
            table = {"epoch": 1, "version": 4, "models": []}
            assert (await c.put("/v1/routing", json=table)).status_code == 401
            c.headers["authorization"] = "Bearer push-token"
            assert (await c.put("/v1/routing", json=table)).status_code == 200
            older = await c.put("/v1/routing", json={**table, "version": 2})
            assert older.status_code == 409 and older.json()["version"] == 4
            bad = await c.put("/v1/routing", content=b"{}")
            assert bad.status_code == 400 and "routing snapshot" in bad.json()["error"]
            assert (await c.get("/v1/routing/held")).json()["version"] == 4
            assert (await c.get("/v1/routing")).content == b'{"version": 3}'
            assert (await c.get("/v1/usage")).json() == {"batches": []}
            assert (await c.post("/v1/usage/ack", content=b"[]")).status_code == 400
            acked = await c.post("/v1/usage/ack", json={"batches": [["run", 1]]})
            assert acked.status_code == 200 and target.acked[0].batches == [("run", 1)]
            target.unavailable = True
            down = await c.put("/v1/routing", json=table)
            assert down.status_code == 503 and "starting" in down.json()["error"]
            assert (await c.get("/v1/routing/held")).status_code == 503

    asyncio.run(go())
