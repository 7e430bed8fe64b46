"""Hypothesis strategies for catalogs over every field a catalog file may set: engines,
arguments and environments, GPU needs, placement, routing, autoscaling with cold holds and
sleep, LoRA adapters, labels. What they draw is mostly valid and sometimes not (a key that
only some engines take, a sleep level without sleeping); a test keeps what `Catalog.new`
accepts, as the control plane does."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from modelfleet.core.catalog import ENGINES, OVER_CAPS, PLACEMENTS, ROUTINGS

# Text as operators and engines write it, with what stores and YAML must carry unharmed:
# accents, quotes, colons, a leading dash, a NUL, words YAML reads as booleans or numbers.
_TRICKY = st.sampled_from(["yes", "null", "1.5", "-x", "a: b", '"q"', "é漢", "\x00z", "~", "0x1F"])
_PLAIN = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), max_codepoint=0x2FFF),
    min_size=1,
    max_size=12,
).filter(lambda s: s.strip() != "")
TEXT = st.one_of(_PLAIN, _TRICKY)
NAMES = st.from_regex(r"[a-z][a-z0-9._/-]{0,15}", fullmatch=True)
SECONDS = st.one_of(
    st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.integers(min_value=1, max_value=10**6),
)
DURATIONS = st.one_of(SECONDS, st.sampled_from(["90s", "2m", "1.5h", "3d"]))
SCALAR = st.one_of(TEXT, st.integers(-(10**9), 10**9), st.floats(-1e9, 1e9, allow_nan=False))


@st.composite
def model(draw: st.DrawFn, name: str, adapter_names: list[str]) -> dict[str, Any]:
    """One model, in a catalog file's keys; each optional key present or not."""
    engine = draw(st.sampled_from(ENGINES))
    raw: dict[str, Any] = {"name": name, "engine": engine}

    def maybe(key: str, values: st.SearchStrategy[Any]) -> None:
        if draw(st.booleans()):
            raw[key] = draw(values)

    if engine == "command":
        raw["command"] = draw(TEXT.map(lambda t: "run " + t + " {port}"))
    maybe("source", TEXT)
    maybe("args", st.lists(SCALAR, max_size=4))
    maybe("env", st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), SCALAR,
                                 max_size=3))  # fmt: skip
    maybe("shards", st.integers(1, 1 if engine == "llamacpp" else 4))
    maybe("gpus_per_shard", st.integers(1, 8))
    maybe("gpu_memory", st.one_of(st.integers(0, 2**41), st.sampled_from(["40GiB", "80GB", "0"])))
    maybe("gpu_model", TEXT)
    maybe("node_labels", st.dictionaries(TEXT, SCALAR, max_size=3))
    maybe("placement", st.sampled_from(PLACEMENTS))
    maybe("startup_timeout", SECONDS)
    maybe("max_parallel", st.integers(1, 8))
    maybe("routing", st.sampled_from(ROUTINGS))
    maybe("first_byte_timeout", SECONDS)
    maybe("max_tokens_cap", st.integers(1, 10**6))
    maybe("max_tokens_over_cap", st.sampled_from(OVER_CAPS))
    if draw(st.booleans()):
        top = draw(st.integers(1, 20))
        scaling: dict[str, Any] = {
            "max": top,
            "target_in_flight": draw(st.floats(0.1, 1000, allow_nan=False)),
        }
        for key in ("scale_up_after", "scale_down_after", "scale_to_zero_after"):
            if draw(st.booleans()):
                scaling[key] = draw(DURATIONS)
        if draw(st.booleans()):
            scaling["min"] = draw(st.integers(0, top))
        raw["autoscale"] = scaling
        maybe("cold_queue", st.integers(1, 10_000))
        maybe("cold_timeout", DURATIONS)
        maybe("idle_action", st.sampled_from(["stop", "sleep"]))
        if raw.get("idle_action") == "sleep" or draw(st.integers(0, 9)) == 0:
            maybe("sleep_level", st.sampled_from([1, 2]))
    else:
        maybe("replicas", st.integers(1, 50))
    if adapter_names:
        rank = draw(st.sampled_from([8, 16, 32, 64]))
        raw["max_lora_rank"] = rank
        raw["adapters"] = [
            {"name": a, "source": draw(TEXT)}
            | ({"max_rank": draw(st.integers(1, rank))} if draw(st.booleans()) else {})
            for a in adapter_names
        ]
        maybe("max_loras", st.integers(1, 8))
    return raw


@st.composite
def catalogs(draw: st.DrawFn, max_models: int = 4) -> list[dict[str, Any]]:
    """A catalog's `models`: up to `max_models`, names unique across models and adapters."""
    count = draw(st.integers(0, max_models))
    names = draw(st.lists(NAMES, min_size=count * 3, max_size=count * 3, unique=True))
    models = []
    for i in range(count):
        adapters = names[count + 2 * i : count + 2 * i + draw(st.integers(0, 2))]
        models.append(draw(model(names[i], adapters)))
    return models
