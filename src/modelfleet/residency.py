"""Which LoRA adapters each replica of a model holds: a pure decision, made by the control
plane alone (so two routers never have one adapter loaded in two places for the same want).

Every adapter of the catalog may be asked for, but a replica holds at most `max_loras`. What is
wanted most goes first: an adapter asked for (`demand`: requests held for it, and how often it
was asked lately) that no replica holds takes a free slot, or else the slot of what is worth
least to keep: a second copy before an only one, then what is asked for least. Slots left free
take the adapters no replica holds, in the catalog's order, then second copies of the most
wanted, so that a small set of adapters is loaded everywhere and a request for any of them is
served at once. What a replica holds is kept as long as nothing wanted more needs its slot:
an engine's load is not free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Residency = dict[str, tuple[str, ...]]  # replica id -> the adapters it should hold


def decide(
    adapters: Sequence[str],
    max_loras: int,
    replicas: Sequence[str],
    held: Mapping[str, Sequence[str]],
    demand: Mapping[str, float],
) -> Residency:
    """What each of `replicas` (the model's serving replicas) should hold, from what it
    holds now (`held`, as last decided) and the `demand` for each adapter (0 when absent)."""
    known = set(adapters)
    order = {name: i for i, name in enumerate(adapters)}
    slots: dict[str, list[str]] = {
        rid: [a for a in dict.fromkeys(held.get(rid, ())) if a in known][:max_loras]
        for rid in sorted(replicas)
    }
    if not slots:
        return {}

    def copies(name: str) -> int:
        return sum(name in names for names in slots.values())

    def worth(name: str) -> tuple[bool, float, int]:
        """How much a resident adapter is worth keeping: an only copy over a second one, then
        by demand, then the catalog's order (earlier first)."""
        return (copies(name) == 1, demand.get(name, 0.0), -order[name])

    def least_full() -> str:
        return min(slots, key=lambda rid: (len(slots[rid]), rid))

    def place(name: str) -> None:
        """Give `name` a free slot, or the slot of what is worth less to keep than it: an
        adapter asked for takes any such; one not asked for takes only a second copy's."""
        rid = least_full()
        if len(slots[rid]) < max_loras:
            slots[rid].append(name)
            return
        victim_rid, victim = min(
            ((r, a) for r, names in slots.items() for a in names),
            key=lambda ra: (worth(ra[1]), ra[0]),
        )
        wanted = demand.get(name, 0.0) > 0
        if worth(victim) < (True, demand.get(name, 0.0), -order[name]) and (
            wanted or copies(victim) > 1
        ):
            slots[victim_rid].remove(victim)
            slots[victim_rid].append(name)

    by_want = sorted(adapters, key=lambda a: (-demand.get(a, 0.0), order[a]))
    for name in by_want:  # the most wanted first, then the rest in the catalog's order
        if not copies(name):
            place(name)
    for rid in slots:  # and then second copies, most wanted first
        for name in by_want:
            if len(slots[rid]) >= max_loras:
                break
            if name not in slots[rid]:
                slots[rid].append(name)
    return {rid: tuple(names) for rid, names in slots.items()}
