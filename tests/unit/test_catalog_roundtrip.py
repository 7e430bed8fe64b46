"""Every catalog the control plane accepts reads back as itself: from the store's form
(`to_dict` as JSON), from the admin API's answer, and from every form `ctl catalog show`
prints it in (`-o yaml`, `-o json`), as `ctl catalog apply` reads a file.

Hypothesis's 200 ms deadline is off: an example that took longer on a loaded machine failed
the test once, for no fault of the catalog."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, assume, given, settings

from modelfleet.controlplane import views
from modelfleet.controlplane.catalogs import API_SOURCE, CatalogKeeper
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.ctl.render import as_json, catalog_yaml
from modelfleet.messages import admin
from modelfleet.store.sqlite import SqliteStore

from ..catalog_kit import catalogs


def accepted(models: list[dict[str, Any]]) -> Catalog:
    try:
        return Catalog.new(models)
    except CatalogInvalid:
        assume(False)
        raise


def same(a: Catalog, b: Catalog) -> None:
    """Equal models, field by field (shown escaped: a difference may be a character that
    does not print), and so the same digest."""
    shown = [json.dumps(m.to_dict(), sort_keys=True) for m in (*a.models, *b.models)]
    assert shown[len(a.models) :] == shown[: len(a.models)]
    assert b.models == a.models
    assert b.digest == a.digest


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs())
def test_the_stored_form_reads_back_equal(models: list[dict[str, Any]]) -> None:
    catalog = accepted(models)
    stored = json.loads(json.dumps(catalog.to_dict(), sort_keys=True))  # as both stores keep it
    same(catalog, Catalog.from_dict(stored))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs())
def test_the_admin_answer_and_ctl_s_yaml_read_back_equal(models: list[dict[str, Any]]) -> None:
    catalog = accepted(models)
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.apply(json.dumps(catalog.to_dict()), API_SOURCE, 1.0)
    wire = views.catalog(keeper).model_dump_json()  # what GET /v1/catalog sends
    answer = admin.CatalogAnswer.model_validate_json(wire)  # what ctl reads
    same(catalog, Catalog.new([m.model_dump(exclude_none=True) for m in answer.models]))
    same(catalog, Catalog.from_yaml(catalog_yaml(answer)))
    # `-o json`: every field, those left unset as null, and the version, digest and dates
    # beside the models; `ctl catalog apply` takes that very file back.
    same(catalog, Catalog.from_yaml(as_json(answer)))


def test_ctl_s_json_of_a_catalog_applies_as_the_same_catalog() -> None:
    """`ctl catalog show -o json` printed `null` for `sleep_level`, `adapters` and
    `max_lora_rank` (and the version and digest beside the models), and `ctl catalog apply`
    refused that very file."""
    model = {"name": "m", "engine": "sim", "autoscale": {"max": 2, "target_in_flight": 4}}
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.apply(json.dumps(Catalog.new([model]).to_dict()), API_SOURCE, 1.0)
    shown = as_json(views.catalog(keeper))
    assert '"sleep_level": null' in shown and '"digest": ' in shown
    applied = keeper.apply(shown, API_SOURCE, 2.0)
    assert not applied.changed and applied.catalog.models == Catalog.new([model]).models


def test_a_null_in_a_catalog_file_means_unset() -> None:
    written = """
models:
  - name: m
    engine: vllm
    replicas: null
    gpu_model: null
    sleep_level: null
    adapters: null
    max_lora_rank: null
    autoscale: null
  - name: s
    engine: sim
    autoscale: {max: 2, target_in_flight: 4, min: null, scale_up_after: null}
    idle_action: null
    cold_timeout: null
"""
    plain = """
models:
  - name: m
    engine: vllm
  - name: s
    engine: sim
    autoscale: {max: 2, target_in_flight: 4}
"""
    same(Catalog.from_yaml(plain), Catalog.from_yaml(written))


def test_a_store_written_with_a_stray_sleep_level_still_opens() -> None:
    """Stores written before the fix hold `sleep_level: 1` beside `idle_action: stop` for every
    autoscaled model; a second start on such a store exited 1."""
    model = {"name": "m", "engine": "sim", "autoscale": {"max": 2, "target_in_flight": 4}}
    old = Catalog.new([model]).to_dict()
    old["models"][0].update(idle_action="stop", sleep_level=1)
    store = SqliteStore(":memory:")
    store.add_catalog("old", 1.0, API_SOURCE, old)
    keeper = CatalogKeeper(store)
    assert keeper.current.models == Catalog.new([model]).models


def test_an_autoscaled_model_is_not_written_with_a_sleep_level_it_cannot_have() -> None:
    stopping = {"name": "m", "engine": "sim", "autoscale": {"max": 2, "target_in_flight": 4}}
    assert "sleep_level" not in Catalog.new([stopping]).to_dict()["models"][0]
    sleeping = stopping | {"name": "s", "idle_action": "sleep", "sleep_level": 2}
    assert Catalog.new([sleeping]).to_dict()["models"][0]["sleep_level"] == 2
