"""Which LoRA adapters each replica of a model holds: a pure decision, made by the control
plane alone (so two routers never have one adapter loaded in two places for the same want).

Every adapter of the catalog may be asked for, but a replica holds at most `max_loras`. An
adapter that requests are waiting for (held by the routers: it is loaded nowhere) takes a free
slot, or else the slot of what is worth least to keep, if that is worth less than it: one
that failed to load there, then a second copy, then one not *pinned*, then what is wanted
least (`Want.weight`: the requests waiting plus how many a second were asked lately, plus one
for every second the oldest of them has waited).

When there are more adapters than slots, the most asked for lately (by rate) are pinned, all
slots but a quarter: a request for one of the rest waits for a rotating slot instead of
evicting an adapter that the next second's requests would ask for again, and the requests
held for it share its one load. Evicting by demand alone swapped the popular adapters in and
out: in `bench/lora.py` (50 adapters, 8 slots) 9.4 loads a second and 35 % of requests
finding their adapter loaded, against 3.3 and 61 % with pinning. The rotating slots go to the
waiting adapters by weight, so the time waited counts: by the requests held alone, an adapter
asked for rarely lost every turn to busier ones, and its one request waited longest.

Slots left free take the adapters no replica holds, in the catalog's order (taking only second
copies' slots), then second copies of the most asked for, so that a small set of adapters is
loaded everywhere and a request for any of them is served at once. Nothing is loaded ahead of
a request into a slot that holds something else: what a replica holds is kept until a waiting
request needs its slot more, since an engine's load is not free and a swap back and forth
serves no one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

Residency = dict[str, tuple[str, ...]]  # replica id -> the adapters it should hold


@dataclass(frozen=True)
class Want:
    """How much one adapter is wanted, as the routers report it."""

    held: int = 0  # requests the routers hold for it now (it is loaded nowhere)
    rate: float = 0.0  # requests a second asked for it lately
    waited: float = 0.0  # seconds the oldest of the requests held has waited (0: none held)

    @property
    def weight(self) -> float:
        """Requests held, requests a second, and a second waited each count one."""
        return self.held + self.rate + self.waited


NO_WANT = Want()


def decide(
    adapters: Sequence[str],
    max_loras: int,
    replicas: Sequence[str],
    held: Mapping[str, Sequence[str]],
    demand: Mapping[str, Want],
    failed: Mapping[str, Collection[str]] = MappingProxyType({}),
    busy: Mapping[str, float] = MappingProxyType({}),
) -> Residency:
    """What each of `replicas` (the model's serving replicas) should hold, from what it
    holds now (`held`, as last decided), the `demand` for each adapter (0 when absent), and
    what failed to load where (`failed`: replica id -> adapters; their slots go first). Of
    replicas with as many free slots, the least `busy` (requests it carries) gets a new
    adapter."""
    known = set(adapters)
    order = {name: i for i, name in enumerate(adapters)}
    slots: dict[str, list[str]] = {
        rid: [a for a in dict.fromkeys(held.get(rid, ())) if a in known][:max_loras]
        for rid in sorted(replicas)
    }
    if not slots:
        return {}

    capacity = max_loras * len(slots)
    rotating = max(1, capacity // 4) if len(adapters) > capacity else 0
    by_rate = sorted(
        (a for a in adapters if demand.get(a, NO_WANT).rate > 0),
        key=lambda a: (-demand[a].rate, order[a]),
    )
    pinned = set(by_rate[: capacity - rotating])

    def copies(name: str) -> int:
        return sum(name in names for names in slots.values())

    def worth(rid: str, name: str) -> tuple[bool, bool, bool, float, int]:
        """How much an adapter is worth keeping on `rid`: one that loads there over one that
        failed to, an only copy over a second one, a pinned one over another, then by
        demand, then the catalog's order (earlier first)."""
        ok = name not in failed.get(rid, ())
        want = demand.get(name, NO_WANT).weight
        return (ok, copies(name) == 1, name in pinned, want, -order[name])

    def least_full() -> str:
        return min(slots, key=lambda rid: (len(slots[rid]), busy.get(rid, 0.0), rid))

    def place(name: str) -> None:
        """Give `name` a free slot, or the slot of what is worth less to keep than it: an
        adapter requests wait for takes any such; another only a failed one's or a copy's."""
        rid = least_full()
        if len(slots[rid]) < max_loras:
            slots[rid].append(name)
            return
        victim_rid, victim = min(
            ((r, a) for r, names in slots.items() for a in names),
            key=lambda ra: (worth(*ra), ra[0]),
        )
        want = demand.get(name, NO_WANT)
        value = worth(victim_rid, victim)
        # On equal worth what is loaded stays: a swap costs a load and gains nothing.
        if value[:4] < (True, True, name in pinned, want.weight) and (
            want.held > 0 or not value[0] or value[1] is False
        ):
            slots[victim_rid].remove(victim)
            slots[victim_rid].append(name)

    by_want = sorted(
        adapters,
        key=lambda a: (not demand.get(a, NO_WANT).held, -demand.get(a, NO_WANT).weight, order[a]),
    )
    # Those waited for, most wanted first, then the rest in the catalog's order.
    for name in by_want:
        if not copies(name):
            place(name)
    for rid in slots:  # and then second copies, most wanted first
        for name in by_want:
            if len(slots[rid]) >= max_loras:
                break
            if name not in slots[rid]:
                slots[rid].append(name)
    return {rid: tuple(names) for rid, names in slots.items()}
