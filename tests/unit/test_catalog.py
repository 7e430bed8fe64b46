"""Catalog validation: one test per rule, several mistakes reported together, immutability."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from modelfleet.core.catalog import Catalog, CatalogInvalid, ModelSpec


def model(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {"name": "m", "engine": "sim"}
    base.update(overrides)
    return base


def problems_of(models: list[dict[str, object]]) -> list[tuple[str, str, str]]:
    with pytest.raises(CatalogInvalid) as info:
        Catalog.new(models)
    return [(p.model, p.field, p.message) for p in info.value.problems]


def test_a_valid_catalog_fills_in_defaults() -> None:
    catalog = Catalog.new([model(replicas=2, gpu_memory="40GiB")])
    spec = catalog.get("m")
    assert spec is not None
    assert (spec.replicas, spec.shards, spec.gpus_per_shard) == (2, 1, 1)
    assert spec.gpu_memory == 40 * 2**30
    assert spec.placement == "spread"
    assert spec.source == "m"


def test_unknown_engine_is_named_with_a_suggestion() -> None:
    [(name, field, message)] = problems_of([model(engine="vlm")])
    assert (name, field) == ("m", "engine")
    assert "'vlm'" in message and "did you mean 'vllm'" in message


def test_missing_engine() -> None:
    [(name, field, message)] = problems_of([{"name": "m"}])
    assert (name, field) == ("m", "engine") and "missing" in message


def test_duplicate_model_name() -> None:
    [(name, field, message)] = problems_of([model(), model()])
    assert (name, field) == ("m", "name") and "duplicate" in message


@pytest.mark.parametrize("key", ["replicas", "shards", "gpus_per_shard"])
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_counts_must_be_positive_integers(key: str, value: object) -> None:
    [(name, field, message)] = problems_of([model(**{key: value})])
    assert (name, field) == ("m", key) and "positive integer" in message


def test_unparseable_memory_size() -> None:
    [(name, field, message)] = problems_of([model(gpu_memory="lots")])
    assert (name, field) == ("m", "gpu_memory") and "'lots'" in message


def test_unknown_key_gets_did_you_mean() -> None:
    [(name, field, message)] = problems_of([model(replica=2)])
    assert (name, field) == ("m", "replica") and "did you mean 'replicas'" in message


@pytest.mark.parametrize("bad", ["../../etc", "<script>", "a b", "/abs", "x" * 129, "m/", ""])
def test_a_name_is_letters_digits_and_a_few_marks_in_parts(bad: str) -> None:
    """Issue 39: `../../etc` and `<script>` were accepted as model and adapter names (they
    become labels, paths and dashboard text)."""
    [(_, field, message)] = problems_of([model(name=bad)])
    assert field == "name" and "name" in message, message
    adapter = {"name": bad, "source": "/models/a"}
    [(_, field, message)] = problems_of([model(adapters=[adapter])])
    assert field == "adapters" and message.startswith("#1: name: ") and "name" in message[10:]


@pytest.mark.parametrize("good", ["meta-llama/Llama-3.1-8B-Instruct", "qwen:7b", "a_b@v2+x"])
def test_names_that_models_are_known_by_are_taken(good: str) -> None:
    assert Catalog.new([model(name=good)]).get(good) is not None


def test_missing_name_is_reported_by_position() -> None:
    [(name, field, message)] = problems_of([model(), {"engine": "sim"}])
    assert (name, field) == ("#2", "name") and "missing" in message


def test_bad_placement_policy() -> None:
    [(name, field, _)] = problems_of([model(placement="scatter")])
    assert (name, field) == ("m", "placement")


def test_args_must_be_a_list_of_strings() -> None:
    [(name, field, _)] = problems_of([model(args="--max-model-len 8192")])
    assert (name, field) == ("m", "args")


def test_labels_must_be_a_mapping() -> None:
    [(name, field, _)] = problems_of([model(node_labels=["zone=a"])])
    assert (name, field) == ("m", "node_labels")


def test_command_engine_needs_a_template_and_others_refuse_one() -> None:
    assert problems_of([model(engine="command")])[0][1] == "command"
    assert problems_of([model(command="serve {port}")])[0][1] == "command"


def test_startup_timeout_must_be_positive() -> None:
    [(name, field, _)] = problems_of([model(startup_timeout=0)])
    assert (name, field) == ("m", "startup_timeout")


def test_several_mistakes_in_one_file_are_reported_together() -> None:
    text = """
models:
  - name: a
    engine: vlm
    replicas: 0
  - name: b
    engine: sim
    gpu_memory: lots
    gpus_per_shard: -2
  - name: a
    engine: sim
  - name: c
    engine: sim
    replica: 3
colour: blue
"""
    with pytest.raises(CatalogInvalid) as info:
        Catalog.from_yaml(text, source="fleet.yaml")
    found = {(p.model, p.field) for p in info.value.problems}
    # The unknown top-level key is reported before the models are looked at.
    assert found == {("-", "colour")}
    with pytest.raises(CatalogInvalid) as info:
        Catalog.from_yaml(text.replace("colour: blue\n", ""), source="fleet.yaml")
    found = {(p.model, p.field) for p in info.value.problems}
    assert found == {
        ("a", "engine"),
        ("a", "replicas"),
        ("b", "gpu_memory"),
        ("b", "gpus_per_shard"),
        ("a", "name"),
        ("c", "replica"),
    }
    text_of_error = str(info.value)
    assert "fleet.yaml" in text_of_error and "6 problem(s)" in text_of_error


def test_invalid_yaml_and_wrong_shapes() -> None:
    for text in ("models: [", "- just a list", "models: {a: 1}", "{}"):
        with pytest.raises(CatalogInvalid):
            Catalog.from_yaml(text)


def test_catalog_is_immutable_and_only_built_by_new() -> None:
    catalog = Catalog.new([model()])
    with pytest.raises(dataclasses.FrozenInstanceError):
        catalog.version = 2  # type: ignore[misc]
    spec = catalog.models[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.replicas = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["X"] = "1"  # type: ignore[index]
    with pytest.raises(TypeError, match=r"Catalog\.new"):
        Catalog(models=(), version=1, digest="x")
    assert isinstance(spec, ModelSpec)


def test_digest_follows_content_and_engine_digest_ignores_scale() -> None:
    one = Catalog.new([model(replicas=1)])
    same = Catalog.new([model(replicas=1)], version=7)
    scaled = Catalog.new([model(replicas=3)])
    changed = Catalog.new([model(args=["--x"])])
    assert one.digest == same.digest and one.version != same.version
    assert one.digest != scaled.digest
    assert one.models[0].engine_digest == scaled.models[0].engine_digest
    assert one.models[0].engine_digest != changed.models[0].engine_digest


def test_round_trip_through_yaml() -> None:
    import yaml

    catalog = Catalog.new([model(replicas=2, node_labels={"zone": "a"}, gpu_model="H100")])
    again = Catalog.from_yaml(yaml.safe_dump(catalog.to_dict()))
    assert again.digest == catalog.digest


def test_llamacpp_runs_one_shard_per_replica() -> None:
    [(name, field, message)] = problems_of([model(engine="llamacpp", shards=2)])
    assert (name, field) == ("m", "shards") and "one shard per replica" in message


def test_a_small_file_of_nested_aliases_makes_a_short_error() -> None:
    """253 bytes of YAML aliases, each level ten times the one below, once made an error of
    5.8 MB that was stored and logged. Aliases are refused now, before anything is built;
    and every problem is cut short, and so are their number."""
    levels = ["- &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        this, below = chr(ord("a") + i), chr(ord("a") + i - 1)
        levels.append(f"- &{this} [{', '.join([f'*{below}'] * 10)}]")
    text = "models:\n" + "\n".join(levels) + "\n- {name: m, engine: *i, args: *i, env: *i}\n"
    with pytest.raises(CatalogInvalid) as info:
        Catalog.from_yaml(text)
    message = str(info.value)
    assert len(message) < 2000, len(message)
    assert "an alias (*a) is not taken" in message
    many = [{"name": f"m{i}", "engine": "vlm"} for i in range(500)]
    with pytest.raises(CatalogInvalid) as info:
        Catalog.new(many)
    assert len(info.value.problems) == 50 and "and 450 more" in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_startup_timeout_must_be_a_finite_number(value: float) -> None:
    [(name, field, _)] = problems_of([model(startup_timeout=value)])
    assert (name, field) == ("m", "startup_timeout")


def test_routing_fields_are_checked_and_change_no_engine() -> None:
    plain = Catalog.new([model()])
    routed = Catalog.new(
        [
            model(
                routing="prefix",
                first_byte_timeout=30,
                max_tokens_cap=4096,
                max_tokens_over_cap="clamp",
            )
        ]
    )
    spec = routed.models[0]
    assert (spec.routing, spec.first_byte_timeout, spec.max_tokens_cap) == ("prefix", 30.0, 4096)
    assert spec.max_tokens_over_cap == "clamp"
    # Routers alone read them: a change of them re-routes and never replaces an engine.
    assert plain.digest != routed.digest
    assert plain.models[0].engine_digest == spec.engine_digest
    found = problems_of(
        [
            model(
                routing="sticky",
                first_byte_timeout=0,
                max_tokens_cap=-5,
                max_tokens_over_cap="truncate",
            )
        ]
    )
    assert sorted(f for _, f, _ in found) == [
        "first_byte_timeout",
        "max_tokens_cap",
        "max_tokens_over_cap",
        "routing",
    ]
    assert any("one of least_load, prefix" in m and "'sticky'" in m for _, _, m in found)


LORA = [
    {"name": "sql", "source": "/lora/sql"},
    {"name": "chat", "source": "org/chat", "max_rank": 8},
]


def test_adapters_default_to_four_slots_and_change_no_engine() -> None:
    spec = Catalog.new([model(adapters=LORA)]).models[0]
    assert [a.name for a in spec.adapters] == ["sql", "chat"] and spec.max_loras == 4
    assert spec.adapter("chat") is not None and spec.adapter("chat").max_rank == 8  # type: ignore[union-attr]
    fewer = Catalog.new([model(adapters=LORA[:1])]).models[0]
    assert fewer.engine_digest == spec.engine_digest  # loaded live: no restart
    more_slots = Catalog.new([model(adapters=LORA, max_loras=8)]).models[0]
    assert more_slots.engine_digest != spec.engine_digest  # the engine's --max-loras
    without = Catalog.new([model()]).models[0]
    assert without.max_loras is None and without.engine_digest != spec.engine_digest
    again = Catalog.from_yaml(yaml.safe_dump(Catalog.new([model(adapters=LORA)]).to_dict()))
    assert again.models[0] == spec


def test_adapter_problems_name_the_adapter_and_the_field() -> None:
    found = problems_of(
        [
            model(
                adapters=[
                    {"name": "a"},
                    {"name": "b", "source": ""},
                    {"nam": "c", "source": "x"},
                    "d",
                ]
            )
        ]
    )
    assert found == [
        ("m", "adapters", "#1: source: missing"),
        ("m", "adapters", "#2: source: must be a non-empty string (a path on the nodes, or a "
         "name the engine resolves), got ''"),
        ("m", "adapters", "#3: name: missing"),
        ("m", "adapters", "#3: nam: unknown key; did you mean 'name'?"),
        ("m", "adapters", "#4: must be a mapping of name, source and max_rank"),
    ]  # fmt: skip


def test_adapter_names_are_unique_across_models_and_adapters() -> None:
    [(_, _, message)] = problems_of(
        [model(adapters=[{"name": "x", "source": "/x"}, {"name": "x", "source": "/y"}])]
    )
    assert message == "#2: duplicate adapter name 'x' (also #1)"
    found = problems_of(
        [
            model(adapters=[{"name": "x", "source": "/x"}]),
            model(name="n", adapters=[{"name": "m", "source": "/m"}, {"name": "n", "source": "s"}]),
            model(name="o", adapters=[{"name": "y", "source": "/m"}]),
            model(name="p", adapters=[{"name": "x", "source": "/x"}]),
            model(name="q", adapters=[{"name": "o", "source": "/o"}]),
        ]
    )
    messages = {(name, message) for name, _, message in found}
    assert ("n", "#2: an adapter cannot be named as its base model") in messages
    assert ("p", "adapter name 'x' is already an adapter of m: a request's model must name "
            "one thing") in messages  # fmt: skip
    assert ("q", "adapter name 'o' is already a model: a request's model must name one "
            "thing") in messages  # fmt: skip
    assert len(messages) == 3  # n's own problem keeps it out; o is fine


def test_adapters_need_an_engine_that_loads_them_and_a_rank_that_fits() -> None:
    [(_, field, message)] = problems_of([model(engine="llamacpp", adapters=LORA)])
    assert field == "adapters" and "cannot load LoRA adapters" in message and "vllm" in message
    [(_, field, message)] = problems_of([model(adapters=LORA, max_lora_rank=4)])
    assert field == "adapters" and "max_rank 8 is over the model's max_lora_rank (4)" in message
    [(_, field, message)] = problems_of([model(max_lora_rank=32)])
    assert field == "max_lora_rank" and "only a model with adapters" in message
    [(_, field, message)] = problems_of([model(adapters=LORA, max_loras=0)])
    assert field == "max_loras" and "positive integer" in message


def test_a_lora_rank_vllm_would_refuse_is_refused_naming_what_it_takes() -> None:
    [(_, field, message)] = problems_of([model(engine="vllm", adapters=LORA, max_lora_rank=24)])
    assert field == "max_lora_rank"
    assert message == (
        "engine 'vllm' takes a max_lora_rank of 1, 8, 16, 32, 64, 128, 256, 320, 512 only, "
        "got 24; the next one up is 32"
    )
    [(_, _, message)] = problems_of([model(engine="vllm", max_loras=2, max_lora_rank=1024)])
    assert message.endswith("got 1024")
    for rank in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        spec = Catalog.new([model(engine="vllm", max_loras=2, max_lora_rank=rank)]).models[0]
        assert spec.max_lora_rank == rank
    # Engines that take any rank keep taking it.
    assert Catalog.new([model(engine="sglang", max_loras=1, max_lora_rank=24)]).models


def test_a_program_runs_the_engine_and_only_a_set_one_changes_its_digest() -> None:
    plain = Catalog.new([model(engine="vllm")]).models[0]
    assert plain.program is None and "program" not in plain.to_dict()
    own = Catalog.new([model(engine="vllm", program="/opt/vllm/bin/vllm")]).models[0]
    assert own.program == "/opt/vllm/bin/vllm" and own.engine_digest != plain.engine_digest
    assert Catalog.new([own.to_dict()]).models[0] == own  # read back as written
    [(_, field, message)] = problems_of([model(engine="command", command="x", program="y")])
    assert (field, message) == (
        "program",
        "engine 'command' names its program in its command template",
    )
    [(_, field, message)] = problems_of([model(engine="vllm", program="'unclosed")])
    assert field == "program" and "cannot be split into words" in message
    [(_, field, message)] = problems_of([model(engine="vllm", program="   ")])
    assert field == "program"


def test_a_catalog_with_an_alias_is_refused_before_it_is_built() -> None:
    """Issue 39: a 20 KB string aliased 10,000 times took a dry run to gigabytes."""
    big = "x" * 20_000
    text = f"big: &big {big}\nmodels:\n  - name: m\n    engine: sim\n    args:\n"
    text += "".join("      - *big\n" for _ in range(10_000))
    with pytest.raises(CatalogInvalid) as info:
        Catalog.from_yaml(text)
    [problem] = info.value.problems
    assert "line 6, column 9: an alias (*big) is not taken" in problem.message
