"""Collecting what every key used from every router, into the store.

Each router counts requests, prompt and completion tokens and errors per key, model and hour
(`router/usage.py`). Every `usage_interval` the control plane takes each router's batch,
adds it to the store (once per batch, whatever happens to the answer) and acknowledges it, so
the router forgets it. A router that dies loses what it counted since its last acknowledged
batch: about one interval. While the store cannot write (a full disk), nothing is
acknowledged: each router keeps its batches and sends them again, until they are stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx
from pydantic import ValidationError

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.series import Recorder, Totals
from modelfleet.messages.wire import UsageAck, UsageBatch, UsageReport
from modelfleet.store import StoredUsage, StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")


class UsageCollector:
    """Takes each router's usage batches into the store."""

    def __init__(
        self,
        routers: Sequence[RouterTarget],
        http: httpx.AsyncClient,
        calls: StoreCalls,
        interval: float,
        wall: Callable[[], float],
        recorder: Recorder,
    ) -> None:
        self.routers = list(routers)
        self.recorder = recorder
        self.http = http
        self.calls = calls
        self.store = calls.store
        self.interval = interval
        self.wall = wall
        self._failure = ""  # the last store failure logged, to log each only once
        self.acting: Callable[[], bool] = lambda: True  # only a leading control plane collects
        self.stored = 0  # batches stored (a batch sent again is stored once)

    async def run(self) -> None:
        """Collect from every router, every interval, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            if self.acting():
                await self.collect()

    async def collect(self) -> None:
        await asyncio.gather(*(self._collect(r) for r in self.routers))

    async def _collect(self, router: RouterTarget) -> None:
        headers = {"authorization": f"Bearer {router.token}"}
        try:
            answer = await self.http.get(f"{router.url}/v1/usage", headers=headers)
            report = UsageReport.model_validate_json(answer.content)
        except (httpx.HTTPError, ValidationError) as exc:
            log.debug("no usage from router %s: %s", router.url, exc)
            return  # unreachable, or a router of an older version: asked again next time
        if not report.batches:
            return
        now = self.wall()
        for batch in report.batches:
            rows = [
                StoredUsage(r.key, r.model, r.hour, r.requests, r.prompt_tokens,
                            r.completion_tokens, r.errors, r.last_at)
                for r in batch.rows
            ]  # fmt: skip
            try:
                if await self.calls(self.store.add_usage, batch.run, batch.batch, rows, now):
                    self.stored += 1
                    self._plot(batch)
            except StoreError as exc:
                # Not acknowledged: the router keeps the batch and sends it again.
                if str(exc) != self._failure:
                    self._failure = str(exc)
                    log.warning("cannot store usage, kept by the routers meanwhile: %s", exc)
                return
        self._failure = ""
        ack = UsageAck(batches=[(b.run, b.batch) for b in report.batches])
        try:
            await self.http.post(
                f"{router.url}/v1/usage/ack",
                content=ack.model_dump_json(),
                headers={**headers, "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            # Stored already; the router sends the batch again and the store counts it once.
            log.debug("router %s did not take the usage acknowledgement: %s", router.url, exc)

    def _plot(self, batch: UsageBatch) -> None:
        """What each key did in a batch stored for the first time, for its plots."""
        for r in batch.rows:
            counted = {
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "errors": r.errors,
                "limited": r.limited,
            }
            self.recorder.add("key", r.key, Totals({k: float(v) for k, v in counted.items()}))
