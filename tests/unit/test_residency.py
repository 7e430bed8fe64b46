"""Which adapters each replica holds (`residency.decide`): bounded, stable, wanted first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from modelfleet.residency import decide

NAMES = [f"a{i}" for i in range(8)]
REPLICAS = ["r1", "r2", "r3"]


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[str], int, list[str], dict, dict]:
    adapters = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8))
    max_loras = draw(st.integers(1, 4))
    replicas = draw(st.lists(st.sampled_from(REPLICAS), unique=True, max_size=3))
    held = {
        rid: draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=5))
        for rid in draw(st.lists(st.sampled_from(REPLICAS), unique=True))
    }
    demand = draw(st.dictionaries(st.sampled_from(NAMES), st.floats(0, 100)))
    return adapters, max_loras, replicas, held, demand


@given(situations())
def test_every_replica_holds_at_most_max_loras_of_its_model_s_adapters(s: tuple) -> None:
    adapters, max_loras, replicas, held, demand = s
    decided = decide(adapters, max_loras, replicas, held, demand)
    assert set(decided) == set(replicas)
    for names in decided.values():
        assert len(names) <= max_loras
        assert len(set(names)) == len(names)
        assert set(names) <= set(adapters)


@given(situations())
def test_every_adapter_is_held_somewhere_when_the_slots_allow(s: tuple) -> None:
    adapters, max_loras, replicas, held, demand = s
    decided = decide(adapters, max_loras, replicas, held, demand)
    if replicas and len(adapters) <= max_loras * len(replicas):
        assert {a for names in decided.values() for a in names} == set(adapters)
    if replicas and len(adapters) >= max_loras:  # and no slot is left empty
        assert all(len(names) == max_loras for names in decided.values())


@given(situations())
def test_a_decision_is_kept_when_nothing_changes(s: tuple) -> None:
    adapters, max_loras, replicas, held, demand = s
    decided = decide(adapters, max_loras, replicas, held, demand)
    assert decide(adapters, max_loras, replicas, decided, demand) == decided


@given(situations())
def test_the_most_wanted_adapter_is_held_and_what_was_held_goes_only_for_more_want(
    s: tuple,
) -> None:
    adapters, max_loras, replicas, held, demand = s
    decided = decide(adapters, max_loras, replicas, held, demand)
    wanted = [a for a in adapters if demand.get(a, 0) > 0]
    if replicas and wanted:
        top = max(wanted, key=lambda a: (demand[a], -adapters.index(a)))
        assert any(top in names for names in decided.values())
    for rid in replicas:
        # What it held of the model's adapters, within its slots (fewer slots drop the rest).
        kept = [a for a in dict.fromkeys(held.get(rid, ())) if a in adapters][:max_loras]
        for name in kept:
            if name in decided[rid]:
                continue
            # It gave up its slot: to something wanted more, or it is held elsewhere still.
            gained = set(decided[rid]) - set(kept)
            elsewhere = any(name in decided[r] for r in replicas if r != rid)
            assert elsewhere or any(demand.get(g, 0) > demand.get(name, 0) for g in gained)


def test_a_held_request_takes_the_slot_of_a_second_copy_before_an_only_one() -> None:
    held = {"r1": ("a", "b"), "r2": ("a", "c")}
    decided = decide(["a", "b", "c", "d"], 2, ["r1", "r2"], held, {"d": 1.0, "b": 0.5})
    assert sorted(decided["r1"] + decided["r2"]) == ["a", "b", "c", "d"]


def test_with_no_demand_the_catalog_s_first_adapters_fill_the_slots_spread_out() -> None:
    assert decide(["a", "b", "c"], 2, ["r1", "r2"], {}, {}) == {
        "r1": ("a", "c"),
        "r2": ("b", "a"),
    }
