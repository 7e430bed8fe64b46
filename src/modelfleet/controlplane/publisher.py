"""The publisher: pushes the routing table to every router and tracks what each confirmed.

A table is pushed whole, with a version that only grows, when it changed, again to each router
that has not confirmed the current version (it was down, or refused), and on a timer so a
router that restarted heals. What the routers confirmed decides when a replica taken out of
service may be stopped: only once no router routes to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx
from pydantic import ValidationError

from modelfleet.admin import RoutingAnswer
from modelfleet.controlplane.config import RouterTarget
from modelfleet.wire import RoutedModel, RoutingAck, RoutingSnapshot

log = logging.getLogger("modelfleet.controlplane")


class Publisher:
    """The routing table last published, its version, and each router's confirmed version."""

    def __init__(self, routers: Sequence[RouterTarget], http: httpx.AsyncClient) -> None:
        self.routers = list(routers)
        self._http = http
        self._published: tuple[int, list[RoutedModel]] | None = None
        self.version = 0
        self._acked: dict[str, int] = {}  # router url -> newest routing version it holds

    async def publish(
        self, catalog_version: int, models: list[RoutedModel], wall: float, force: bool = False
    ) -> None:
        """Push the table to every router when it changed (or when forced), and again to each
        router that has not confirmed the current one. `wall` (epoch seconds) seeds the version,
        so a restarted control plane publishes newer versions than the routers hold."""
        published = (catalog_version, models)
        if published != self._published:
            self._published = published
            self.version = max(self.version + 1, int(wall * 1000))
            force = True
        routers = [r for r in self.routers if force or self._acked.get(r.url, -1) < self.version]
        if not routers:
            return
        snapshot = RoutingSnapshot(
            version=self.version, catalog_version=catalog_version, models=models
        )
        body = snapshot.model_dump_json()
        await asyncio.gather(*(self._push(r, body) for r in routers))

    async def _push(self, router: RouterTarget, body: str) -> None:
        url = router.url
        try:
            response = await self._http.put(
                f"{url}/v1/routing",
                content=body,
                headers={
                    "authorization": f"Bearer {router.token}",
                    "content-type": "application/json",
                },
            )
        except httpx.HTTPError as exc:
            log.warning("push to router %s failed: %s", url, exc)
            return
        if response.status_code not in (200, 409):
            log.warning("router %s refused the push: %s", url, response.text[:200])
            return
        try:
            held = RoutingAck.model_validate_json(response.content).version
        except ValidationError:
            log.warning("router %s answered the push with no version", url)
            return
        self._acked[url] = max(held, self._acked.get(url, -1))

    def routed_version(self) -> int:
        """The oldest routing version a router still holds: a replica left out of this version
        or an older one is out of every router's table."""
        return min((self._acked.get(r.url, -1) for r in self.routers), default=self.version)

    def answer(self) -> RoutingAnswer:
        catalog_version, models = self._published or (0, [])
        return RoutingAnswer(
            version=self.version,
            catalog_version=catalog_version,
            models=models,
            routers=dict(self._acked),
        )
