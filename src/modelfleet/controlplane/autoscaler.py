"""The replica count of each model that follows its load: the control plane is its only writer.

The catalog gives each such model its bounds (`autoscale`); how many replicas it has now is
decided here, by `autoscale.decide` on the routers' load (`loads.py`), and kept in the store
(meta `autoscale`), so that a control plane that takes over leads on with the same counts.
The planner takes these counts in place of a fixed `replicas`. Every change is an event with
the numbers that made it. A model whose replicas are being replaced (a drain, a move) is not
scaled below what it has: the replacements are counted on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.loads import Load
from modelfleet.core.autoscale import Trend, decide, up_due
from modelfleet.core.catalog import Catalog, ModelSpec
from modelfleet.store import StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")

STORE_KEY = "autoscale"


@dataclass(frozen=True)
class Scale:
    """A model's replica count, why it was last changed, and when (wall-clock seconds)."""

    replicas: int
    reason: str
    at: float


class Autoscaler:
    """The counts of the models that follow their load, and the decisions that set them."""

    def __init__(self, calls: StoreCalls, events: EventLog, wall: Callable[[], float]) -> None:
        self.calls = calls
        self.store = calls.store
        self.events = events
        self.wall = wall
        self.scales: dict[str, Scale] = {}
        self.trends: dict[str, Trend] = {}
        self.lately: dict[str, tuple[float, str]] = {}  # model -> (load, the last decision's why)
        # Counts decided while the store was down (`stand_in`): stored when a term begins.
        self.unrecorded: dict[str, Scale] = {}

    def stored(self) -> str | None:
        """The counts as the store keeps them (store I/O: run off the event loop)."""
        return self.store.get_meta(STORE_KEY)

    def load(self, raw: str | None) -> None:
        """Take the counts the store kept (`stored`): a term begins, or a follower reads. What
        the trends were is not kept: a term starts them anew."""
        self.scales = {}
        self.trends = {}
        if raw is None:
            return
        try:
            for model, data in json.loads(raw).items():
                self.scales[model] = Scale(int(data["replicas"]), str(data["reason"]), data["at"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("the stored autoscale counts cannot be read (%s); starting from min", exc)
            self.scales = {}

    def stand_in(self, model: str, reason: str) -> None:
        """`model`, at zero, was started with one replica while the store is down: counted
        in memory, and stored when the next term this control plane leads begins
        (`record_stood_in`)."""
        scale = Scale(1, reason, self.wall())
        self.scales[model] = self.unrecorded[model] = scale
        log.info("%s: 0 -> 1 replicas: %s", model, reason)
        self.events.normal("ReplicasScaled", f"model/{model}", f"0 -> 1: {reason}")

    def record_stood_in(self) -> None:
        """The counts decided while the store was down, put into those the store keeps
        (store I/O, as a term this control plane leads begins; raises StoreError)."""
        if not self.unrecorded:
            return
        try:
            body = json.loads(self.stored() or "{}")
        except ValueError:
            body = {}
        body.update({m: dataclasses.asdict(s) for m, s in self.unrecorded.items()})
        self.store.set_meta(STORE_KEY, json.dumps(body, sort_keys=True))
        self.unrecorded = {}

    def current(self, spec: ModelSpec) -> int:
        """`spec`'s replica count now: the one decided, or its `min` before any decision."""
        assert spec.autoscale is not None
        scale = self.scales.get(spec.name)
        return spec.autoscale.min if scale is None else scale.replicas

    def wanted(self, catalog: Catalog) -> dict[str, int]:
        """The replica count of every model of `catalog` that follows its load, within the
        bounds `catalog` gives it (a catalog that narrowed them applies at once)."""
        return {
            s.name: min(s.autoscale.max, max(s.autoscale.min, self.current(s)))
            for s in catalog.models
            if s.autoscale is not None
        }

    def next_due(self, catalog: Catalog) -> float | None:
        """The monotonic time at which a model over its target (and under its max) has been
        so long enough to go up (the next decision that may scale up), if any."""
        due = [
            when
            for spec in catalog.models
            if spec.autoscale is not None
            and (trend := self.trends.get(spec.name)) is not None
            and self.current(spec) < spec.autoscale.max
            and (when := up_due(spec.autoscale, trend)) is not None
        ]
        return min(due, default=None)

    async def step(
        self,
        catalog: Catalog,
        loads: Mapping[str, Load] | None,
        now: float,
        replacing: Collection[str] = (),
    ) -> list[str]:
        """Decide every model that follows its load at monotonic time `now`; returns those
        whose count changed. With `loads` None (no router heard from) nothing changes: no
        signal is not no load. Models in `replacing` are not scaled below their count."""
        gone = [m for m in self.scales if (s := catalog.get(m)) is None or s.autoscale is None]
        if loads is None and not gone:
            return []
        changed: dict[str, Scale] = {}
        notes: list[tuple[str, int, Scale]] = []
        for spec in catalog.models:
            if spec.autoscale is None or loads is None:
                continue
            current = self.current(spec)
            load = loads.get(spec.name, Load())
            # Requests held for its adapters wait for its replicas too (at zero, for one to
            # start): a router holds them under the adapter's name.
            waiting = sum(loads[a.name].held for a in spec.adapters if a.name in loads)
            if waiting:
                load = dataclasses.replace(
                    load, total=load.total + waiting, held=load.held + waiting
                )
            floor = current if spec.name in replacing else 0
            trend = self.trends.get(spec.name, Trend())
            decision = decide(
                spec.autoscale, current, load.total, now, trend, floor, held=load.held
            )
            self.trends[spec.name] = decision.trend
            self.lately[spec.name] = (load.total, decision.reason)
            if decision.changed(current) or spec.name not in self.scales:
                scale = Scale(decision.replicas, decision.reason, self.wall())
                changed[spec.name] = scale
                if decision.changed(current):
                    notes.append((spec.name, current, scale))
        if not changed and not gone:
            return []
        kept = {m: s for m, s in self.scales.items() if m not in gone}
        kept.update(changed)
        body = {m: dataclasses.asdict(s) for m, s in kept.items()}
        try:
            await self.calls(self.store.set_meta, STORE_KEY, json.dumps(body, sort_keys=True))
        except StoreError as exc:  # not leading any more, or the store cannot write
            log.warning("cannot store the autoscale counts (%s); nothing is scaled", exc)
            return []
        self.scales = kept
        for model in gone:
            self.trends.pop(model, None)
            self.lately.pop(model, None)
        for model, was, scale in notes:
            log.info("%s: %d -> %d replicas: %s", model, was, scale.replicas, scale.reason)
            self.events.normal(
                "ReplicasScaled", f"model/{model}", f"{was} -> {scale.replicas}: {scale.reason}"
            )
        return [model for model, _, _ in notes]
