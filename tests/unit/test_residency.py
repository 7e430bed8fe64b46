"""Which adapters each replica holds (`residency.decide`): bounded, stable, wanted first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from modelfleet.core.residency import Want, decide

NAMES = [f"a{i}" for i in range(8)]
REPLICAS = ["r1", "r2", "r3"]


def _want(held: int, rate: float, waited: float) -> Want:
    """As routers report it: a time waited only while requests are held."""
    return Want(held, rate, waited if held else 0.0)


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[str], int, list[str], dict, dict]:
    adapters = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8))
    max_loras = draw(st.integers(1, 4))
    replicas = draw(st.lists(st.sampled_from(REPLICAS), unique=True, max_size=3))
    held = {
        rid: draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=5))
        for rid in draw(st.lists(st.sampled_from(REPLICAS), unique=True))
    }
    demand = draw(
        st.dictionaries(
            st.sampled_from(NAMES),
            st.builds(_want, st.integers(0, 5), st.floats(0, 100), st.floats(0, 60)),
        )
    )
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


def _pinned(adapters: list[str], max_loras: int, replicas: list[str], demand: dict) -> set:
    """The module's rule: with more adapters than slots, the most asked for by rate keep all
    slots but a quarter."""
    capacity = max_loras * len(replicas)
    rotating = max(1, capacity // 4) if len(adapters) > capacity else 0
    asked = [a for a in adapters if demand.get(a, Want()).rate > 0]
    asked.sort(key=lambda a: (-demand[a].rate, adapters.index(a)))
    return set(asked[: capacity - rotating])


@given(situations())
def test_the_most_wanted_adapter_is_held_and_what_was_held_goes_only_for_more_want(
    s: tuple,
) -> None:
    adapters, max_loras, replicas, held, demand = s
    decided = decide(adapters, max_loras, replicas, held, demand)
    pinned = _pinned(adapters, max_loras, replicas, demand)

    def rank(name: str) -> tuple[bool, float]:  # what decides who keeps a slot
        return name in pinned, demand.get(name, Want()).weight

    waiting = [a for a in adapters if demand.get(a, Want()).held > 0]
    if replicas and waiting:
        # What requests wait for most is loaded somewhere, unless every slot holds something
        # worth as much (on a tie what is loaded stays: a swap would gain nothing).
        top = max(waiting, key=lambda a: (*rank(a), -adapters.index(a)))
        assert any(top in names for names in decided.values()) or all(
            len(names) == max_loras and all(rank(d) >= rank(top) for d in names)
            for names in decided.values()
        )
    for rid in replicas:
        # What it held of the model's adapters, within its slots (fewer slots drop the rest).
        kept = [a for a in dict.fromkeys(held.get(rid, ())) if a in adapters][:max_loras]
        for name in kept:
            if name in decided[rid]:
                continue
            # It gave up its slot: to something waited for and worth more (pinned, or else
            # wanted more), or it is held elsewhere still.
            gained = set(decided[rid]) - set(kept)
            elsewhere = any(name in decided[r] for r in replicas if r != rid)
            assert elsewhere or any(
                demand.get(g, Want()).held > 0 and rank(g) > rank(name) for g in gained
            )


def test_a_held_request_takes_the_slot_of_a_second_copy_before_an_only_one() -> None:
    held = {"r1": ("a", "b"), "r2": ("a", "c")}
    demand = {"d": Want(held=1), "b": Want(rate=0.5)}
    decided = decide(["a", "b", "c", "d"], 2, ["r1", "r2"], held, demand)
    assert sorted(decided["r1"] + decided["r2"]) == ["a", "b", "c", "d"]


def test_with_no_demand_the_catalog_s_first_adapters_fill_the_slots_spread_out() -> None:
    assert decide(["a", "b", "c"], 2, ["r1", "r2"], {}, {}) == {
        "r1": ("a", "c"),
        "r2": ("b", "a"),
    }


def test_the_slot_of_an_adapter_that_failed_to_load_goes_first() -> None:
    held = {"r1": ("a", "bad")}
    assert decide(["a", "bad", "c"], 2, ["r1"], held, {}, {"r1": {"bad"}}) == {"r1": ("a", "c")}
    # With nothing else to hold, it keeps it (and its agent keeps reporting why it failed).
    assert decide(["a", "bad"], 2, ["r1"], held, {}, {"r1": {"bad"}}) == {"r1": ("a", "bad")}


def test_nothing_is_loaded_ahead_of_a_request_in_place_of_what_a_replica_holds() -> None:
    held = {"r1": ("a",)}
    often = {"b": Want(rate=50.0), "a": Want(rate=0.1)}
    assert decide(["a", "b"], 1, ["r1"], held, often) == {"r1": ("a",)}
    waiting = {"b": Want(held=1, rate=0.5), "a": Want(rate=5.0)}  # asked more, but none waits
    assert decide(["a", "b"], 1, ["r1"], held, waiting) == {"r1": ("a",)}
    assert decide(["a", "b"], 1, ["r1"], held, {"b": Want(held=6)}) == {"r1": ("b",)}


def test_of_replicas_with_as_many_free_slots_the_least_busy_gets_a_new_adapter() -> None:
    names, held, waiting = (
        ["a", "b", "c", "d", "e"],
        {"r1": ("a",), "r2": ("b",)},
        {"c": Want(held=1)},
    )
    calm_r2 = decide(names, 2, ["r1", "r2"], held, waiting, busy={"r1": 9.0})
    assert "c" in calm_r2["r2"] and "c" not in calm_r2["r1"]
    calm_r1 = decide(names, 2, ["r1", "r2"], held, waiting, busy={"r2": 9.0})
    assert "c" in calm_r1["r1"] and "c" not in calm_r1["r2"]


def test_a_rotating_slot_goes_to_the_longest_waited_for_not_only_to_the_most_held() -> None:
    names = ["a", "b", "rare", "busy"]
    held = {"r1": ("a", "b")}
    fresh = {
        "a": Want(rate=3.0),  # pinned: the most asked for
        "b": Want(rate=0.1),
        "busy": Want(held=5, rate=1.0, waited=0.5),
        "rare": Want(held=1, rate=0.05),
    }
    assert "busy" in decide(names, 2, ["r1"], held, fresh)["r1"]
    # The rare one's request has waited 20 s: it goes first, the busy one's five wait a turn.
    waited = {**fresh, "rare": Want(held=1, rate=0.05, waited=20.0)}
    decided = decide(names, 2, ["r1"], held, waited)["r1"]
    assert "rare" in decided and "busy" not in decided
