"""The publisher: gets the routing table to every router and tracks what each holds.

A table is pushed whole. Its version is (epoch, counter): the epoch is one more at every start
of the control plane (kept in its store), the counter one more at every change, so versions
order correctly across restarts and clock steps, and a router holding a table of an older
epoch takes the new one. Each router is served by a task of its own: pushed to when the table
changes, and asked every `check_interval` which table it holds, so a router that restarted, or
missed a push, gets the current table within that interval. A push is bounded by the HTTP
client's timeout and never holds up a reconcile pass or an agent's report. Only a push the
router took counts as its confirmation, and what the routers confirmed decides when a replica
taken out of service may be stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx
from pydantic import TypeAdapter, ValidationError

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.metrics import ControlPlaneMetrics
from modelfleet.host.clock import wait_set
from modelfleet.messages.admin import RoutedInfo, RoutingAnswer
from modelfleet.messages.wire import (
    ROUTER_RUN_HEADER,
    EngineClient,
    RoutedKey,
    RoutedModel,
    RoutingAck,
    RoutingSnapshot,
)

log = logging.getLogger("modelfleet.controlplane")


class Publisher:
    """The routing table last published and what each router holds."""

    def __init__(
        self,
        routers: Sequence[RouterTarget],
        http: httpx.AsyncClient,
        epoch: int,
        check_interval: float,
        metrics: ControlPlaneMetrics | None = None,
        events: EventLog | None = None,
        acting: Callable[[], bool] = lambda: True,
        confirmed: Callable[[], None] = lambda: None,
        engine_client: EngineClient | None = None,
    ) -> None:
        self.engine_client = engine_client  # sent with every table: routers need it at once
        self.acting = acting  # only a leading control plane pushes or asks
        self._on_confirmed = confirmed  # told when every router holds the current table
        self.metrics = metrics or ControlPlaneMetrics()
        self.events = events
        self._failing: set[str] = set()  # routers whose last push failed
        self._published_at = 0.0  # time.monotonic() of the last publication
        self.routers = list(routers)
        self.epoch = epoch
        self.version = 0
        self.check_interval = check_interval
        self._http = http
        self._published: tuple[int, list[RoutedModel], list[RoutedKey]] | None = None
        self._body = ""
        # id of a model's entry -> (that entry, its JSON): a change of one model's endpoints
        # makes that model's JSON again, not the whole table's.
        self._json: dict[int, tuple[RoutedModel, str]] = {}
        self._held: dict[str, tuple[int, int]] = {}  # router url -> (epoch, version) it took
        self._runs: dict[str, str] = {}  # router url -> the run of it last heard from
        self._wake = {r.url: asyncio.Event() for r in self.routers}

    def new_term(self, epoch: int) -> None:
        """This control plane leads anew under routing `epoch`: nothing published in it yet,
        and what routers were seen to hold is of an older epoch."""
        self.epoch = epoch
        self.version = 0
        self._published = None
        self._held.clear()

    def publish(
        self, catalog_version: int, models: list[RoutedModel], keys: list[RoutedKey]
    ) -> bool:
        """Make `models` and `keys` the table to publish; a new version when it changed.
        Returns whether it changed. The routers' tasks push it; nothing here waits for them."""
        published = (catalog_version, models, keys)
        if published == self._published:
            return False
        self._published = published
        self._published_at = time.monotonic()
        self.version += 1
        # The body of a `RoutingSnapshot`, put together from each model's JSON.
        head = RoutingSnapshot(
            epoch=self.epoch,
            version=self.version,
            catalog_version=catalog_version,
            models=[],
            engine_client=self.engine_client,
        ).model_dump_json(exclude={"models", "keys"})
        keys_json = TypeAdapter(list[RoutedKey]).dump_json(keys).decode()
        models_json = ",".join(self._model_json(m) for m in models)
        self._body = f'{head[:-1]},"models":[{models_json}],"keys":{keys_json}}}'
        used = {id(m) for m in models}
        self._json = {k: v for k, v in self._json.items() if k in used}
        for wake in self._wake.values():
            wake.set()
        return True

    @property
    def body(self) -> str:
        """What a push sends: the JSON of the current `RoutingSnapshot`."""
        return self._body

    def _model_json(self, model: RoutedModel) -> str:
        kept = self._json.get(id(model))
        if kept is None or kept[0] is not model:
            kept = (model, model.model_dump_json())
            self._json[id(model)] = kept
        return kept[1]

    def current(self, router: RouterTarget) -> bool:
        """Whether `router` confirmed the table last published."""
        return self._held.get(router.url) == (self.epoch, self.version)

    async def sync(self) -> None:
        """Push the current table to every router that has not confirmed it, concurrently."""
        await asyncio.gather(*(self._push(r) for r in self.routers if not self.current(r)))

    async def run(self) -> None:
        """Serve every router, each in its own task, until cancelled."""
        async with asyncio.TaskGroup() as group:
            for router in self.routers:
                group.create_task(self._serve(router), name=f"router {router.url}")

    async def _serve(self, router: RouterTarget) -> None:
        wake = self._wake[router.url]
        while True:
            if not self.acting():
                await asyncio.sleep(self.check_interval)
                continue
            if self._published is not None and not self.current(router):
                await self._push(router)
            if not await wait_set(wake, self.check_interval):
                await self.check(router)
            wake.clear()

    def _headers(self, router: RouterTarget) -> dict[str, str]:
        return {"authorization": f"Bearer {router.token}", "content-type": "application/json"}

    async def _push(self, router: RouterTarget) -> None:
        if self._published is None:
            return
        url, version = router.url, (self.epoch, self.version)
        try:
            response = await self._http.put(
                f"{url}/v1/routing", content=self._body, headers=self._headers(router)
            )
        except httpx.HTTPError as exc:
            log.warning("push to router %s failed: %s", url, exc)
            self.metrics.pushes.labels(url, "unreachable").inc()
            self._missed(url, f"unreachable: {type(exc).__name__}")
            return
        try:
            ack = RoutingAck.model_validate_json(response.content)
        except ValidationError:
            log.warning("router %s answered the push with %d: %s", url, response.status_code,
                        response.text[:200])  # fmt: skip
            self.metrics.pushes.labels(url, "refused").inc()
            self._missed(url, f"answered {response.status_code}")
            return
        self._heard_run(url, response, f"that answered a push of version {version}")
        if response.status_code == 200 and ack.applied and (ack.epoch, ack.version) == version:
            self.metrics.pushes.labels(url, "confirmed").inc()
            self._confirmed(url, version)
        else:
            self.metrics.pushes.labels(url, "refused").inc()
            self._missed(url, f"refused it, holding {(ack.epoch, ack.version)}")
            log.warning(
                "router %s refused routing version %s (it holds %s)",
                url,
                version,
                (ack.epoch, ack.version),
            )

    def _heard_run(self, url: str, response: httpx.Response, held: str) -> None:
        """Note which run of the router at `url` answered; a new one (it restarted, seen down
        or not: one that restores its table file is back between two checks) is an event."""
        run = response.headers.get(ROUTER_RUN_HEADER)
        if run is None:  # a router from before it said
            return
        was, self._runs[url] = self._runs.get(url), run
        if was is not None and was != run and self.events is not None:
            self.events.normal("RouterRestarted", f"router/{url}", f"a new run of it, {held}")

    def _missed(self, url: str, why: str) -> None:
        """An event for a push a router missed (a repeat counts up)."""
        self._failing.add(url)
        if self.events is not None:
            self.events.warning("PushMissed", f"router/{url}", f"routing table not taken: {why}")

    def _confirmed(self, url: str, version: tuple[int, int]) -> None:
        """`url` holds `version`; the first time it holds the current one, how long that took
        since its publication is counted (and a router back after missed pushes is told)."""
        if url in self._failing:
            self._failing.discard(url)
            if self.events is not None:
                self.events.normal("PushConfirmed", f"router/{url}", f"holds version {version}")
        if self._held.get(url) != version and version == (self.epoch, self.version):
            waited = time.monotonic() - self._published_at
            self.metrics.confirm_seconds.labels(url).observe(waited)
        self._held[url] = version
        if all(self.current(r) for r in self.routers):
            self._on_confirmed()

    async def check(self, router: RouterTarget) -> None:
        """Ask `router` which table it holds; one that lost ours (it restarted) is pushed to."""
        try:
            response = await self._http.get(
                f"{router.url}/v1/routing/held", headers=self._headers(router)
            )
            ack = RoutingAck.model_validate_json(response.content)
        except (httpx.HTTPError, ValidationError) as exc:
            # Unreachable or not a router: the next check asks again. Told once per spell.
            if router.url not in self._failing:
                self._missed(router.url, f"unreachable: {type(exc).__name__}")
            return
        held = (ack.epoch, ack.version) if ack.applied else (-1, -1)
        holds = f"version {held}" if ack.applied else "no table pushed to this run of it"
        self._heard_run(router.url, response, f"that holds {holds}")
        if held == (self.epoch, self.version):
            self._confirmed(router.url, held)
            return
        if router.url in self._held:
            log.info("router %s now holds %s; pushing the current table", router.url, held)
        self._held.pop(router.url, None)
        await self._push(router)

    def routed_version(self) -> int:
        """The oldest version of this epoch that a router holds (-1 when one holds none of
        it): a replica left out of this version or an older one is out of every table."""
        held = [self._held.get(r.url, (-1, -1)) for r in self.routers]
        return min((v if e == self.epoch else -1 for e, v in held), default=self.version)

    def answer(self) -> RoutingAnswer:
        catalog_version, models, _ = self._published or (0, [], [])
        return RoutingAnswer(
            epoch=self.epoch,
            version=self.version,
            catalog_version=catalog_version,
            models=[
                RoutedInfo(name=m.name, endpoints=m.endpoints, keyed=sorted(m.keys)) for m in models
            ],
            routers={url: v for url, (e, v) in self._held.items() if e == self.epoch},
        )
