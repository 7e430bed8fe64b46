"""The load each model carries, as the routers see it: what autoscaling follows.

The leading control plane long-polls each router's push API (`GET /v1/load?wait=1`): a
router answers after a second, or at once when a model with no replica gets its first held
request or a model goes over its target or into a burst (`autoscale.pressure`), so that a
cold start, or the time over the target, begins without waiting for the next second.
Routers never call the control plane.

A model's load sums what the routers hold for it and the larger of two counts of what its
replicas carry: the routers' requests in flight there, summed over routers, and the engines'
own running and waiting requests (each router reads every engine of the model; the largest
reading is kept). Not their sum: every request a router sent is also in its engine's count,
and a sum would count it twice. The engines' count takes in what reached them some other way,
and the engines' waiting queues.

A router whose last answer is older than `stale_after` is left out; with no fresh router the
load is unknown (`ModelLoads.known` false), and autoscaling changes nothing.

Each answer also names the replicas that router has taken out of rotation (an engine that
failed again and again, or stopped answering): a replica newly out is an event, with the
router's reason, so that `ctl events` says why a replica gets no requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.events import EventLog
from modelfleet.messages.wire import Ejection, LoadReport

log = logging.getLogger("modelfleet.controlplane")

POLL_WAIT_S = 1.0  # how long a router holds the long poll when nothing is new
# The least time between two polls of one router: one that answers at once every time (news
# after news) costs at most this many polls a second.
POLL_GAP_S = 0.05


@dataclass(frozen=True)
class Load:
    """One model's load: requests to carry in all, and per replica id."""

    total: float = 0.0
    held: int = 0  # of `total`: requests routers hold while no replica serves
    replicas: Mapping[str, float] = field(default_factory=dict)
    # Per replica id, as the routers last read its engine: requests running and waiting
    # there, and the share of its KV cache in use (the largest reading of any router).
    engines: Mapping[str, int] = field(default_factory=dict)
    cache: Mapping[str, float] = field(default_factory=dict)
    rate: float = 0.0  # a LoRA adapter: requests per second asked lately, over every router
    waited: float = 0.0  # a LoRA adapter: seconds its oldest held request has waited


def combine(reports: Iterable[LoadReport]) -> dict[str, Load]:
    """Each model's load from the routers' reports (see the module's docstring)."""
    sent: dict[str, int] = {}
    held: dict[str, int] = {}
    engines: dict[str, int] = {}
    per_sent: dict[str, dict[str, int]] = {}
    per_engine: dict[str, dict[str, int]] = {}
    rates: dict[str, float] = {}
    waited: dict[str, float] = {}
    cache: dict[str, dict[str, float]] = {}
    for report in reports:
        for model, load in report.models.items():
            rates[model] = rates.get(model, 0.0) + load.rate
            waited[model] = max(waited.get(model, 0.0), load.waited)
            sent[model] = sent.get(model, 0) + load.in_flight
            held[model] = held.get(model, 0) + load.held
            engines[model] = max(engines.get(model, 0), load.engines)
            s, e = per_sent.setdefault(model, {}), per_engine.setdefault(model, {})
            for rid, (to_it, at_engine) in load.replicas.items():
                s[rid] = s.get(rid, 0) + to_it
                e[rid] = max(e.get(rid, 0), at_engine)
            c = cache.setdefault(model, {})
            for rid, share in load.cache.items():
                c[rid] = max(c.get(rid, 0.0), share)
    return {
        model: Load(
            total=held[model] + max(sent[model], engines[model]),
            held=held[model],
            replicas={
                rid: float(max(n, per_engine[model].get(rid, 0)))
                for rid, n in per_sent[model].items()
            },
            engines=dict(per_engine[model]),
            cache=dict(cache[model]),
            rate=rates[model],
            waited=waited[model],
        )
        for model in sent
    }


def told(url: str, ejection: Ejection, out_s: float | None = None) -> str:
    """Why router `url` sends a replica no requests (for `out_s` seconds so far), in words."""
    again = f" (out {ejection.times} times in a row)" if ejection.times > 1 else ""
    since = f" for {out_s:.0f}s" if out_s is not None else ""
    return (
        f"router {url} sends it no requests{since}: {ejection.why}; a health probe in "
        f"{ejection.left_s:.0f}s decides whether it is back{again}"
    )


class LoadCollector:
    """Long-polls every router for its load, while `acting`."""

    def __init__(
        self,
        routers: Sequence[RouterTarget],
        http: httpx.AsyncClient,
        monotonic: Callable[[], float],
        events: EventLog,
        stale_after: float = 3.0,
    ) -> None:
        self.routers = list(routers)
        self.http = http
        self.monotonic = monotonic
        self.events = events
        self.stale_after = stale_after
        self.acting: Callable[[], bool] = lambda: True
        self.reports: dict[str, tuple[float, LoadReport]] = {}  # router url -> (when, report)
        self.news = asyncio.Event()  # a report came: the autoscaler looks at once
        self._failing: set[str] = set()  # routers whose last poll failed (logged once)
        self._out_since: dict[tuple[str, str], float] = {}  # (replica, router url) -> when

    def loads(self, now: float) -> dict[str, Load] | None:
        """Each model's load from the routers heard from within `stale_after`; None when
        none was."""
        fresh = [r for at, r in self.reports.values() if now - at <= self.stale_after]
        if not fresh:
            return None
        return combine(fresh)

    def limits_per_worker(self) -> dict[str, int]:
        """Router url -> its workers, for each router (as it last reported) that counts keys'
        limits in each worker's memory: a key gets up to that many times its limits there."""
        return {
            url: report.limit_counts
            for url, (_, report) in sorted(self.reports.items())
            if report.limit_counts > 1
        }

    async def run(self) -> None:
        """Poll every router until cancelled, each in a loop of its own."""
        await asyncio.gather(*(self._poll(r) for r in self.routers))

    async def _poll(self, router: RouterTarget) -> None:
        headers = {"authorization": f"Bearer {router.token}"}
        while True:
            await asyncio.sleep(POLL_GAP_S)
            if not self.acting():
                self.reports.pop(router.url, None)
                await asyncio.sleep(POLL_WAIT_S)
                continue
            try:
                answer = await self.http.get(
                    f"{router.url}/v1/load",
                    params={"wait": POLL_WAIT_S},
                    headers=headers,
                    timeout=POLL_WAIT_S + 5,
                )
                answer.raise_for_status()
                report = LoadReport.model_validate_json(answer.content)
            except (httpx.HTTPError, ValidationError) as exc:
                if router.url not in self._failing:
                    log.warning("cannot read the load of router %s: %s", router.url, exc)
                    self._failing.add(router.url)
                await asyncio.sleep(POLL_WAIT_S)
                continue
            if router.url in self._failing:
                log.info("reading the load of router %s again", router.url)
                self._failing.discard(router.url)
            was = self.reports.get(router.url)
            self.reports[router.url] = (self.monotonic(), report)
            self._tell_ejections(router.url, was[1].ejected if was else {}, report.ejected)
            self.news.set()

    def ejections(self, now: float) -> dict[str, list[str]]:
        """Replica id -> why each router that has it out of rotation sends it nothing, and
        for how long, from the routers heard from within `stale_after`."""
        found: dict[str, list[str]] = {}
        for url, (at, report) in sorted(self.reports.items()):
            if now - at <= self.stale_after:
                for rid, ejection in report.ejected.items():
                    out_s = now - self._out_since.get((rid, url), now)
                    found.setdefault(rid, []).append(told(url, ejection, out_s))
        return found

    def _tell_ejections(
        self, url: str, was: Mapping[str, Ejection], now: Mapping[str, Ejection]
    ) -> None:
        at = self.monotonic()
        for rid, ejection in now.items():
            if rid not in was:
                self._out_since[(rid, url)] = at
                self.events.warning("ReplicaEjected", f"replica/{rid}", told(url, ejection))
        for rid in was.keys() - now.keys():
            out_s = at - self._out_since.pop((rid, url), at)
            self.events.normal(
                "ReplicaReturned",
                f"replica/{rid}",
                f"router {url} sends it requests again, after {out_s:.0f}s out of rotation",
            )
