"""Client API keys managed live: the control plane's key book, what it publishes, and the
router taking pushed keys (with its own config's keys kept beside them)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from modelfleet.controlplane.keys import KeyBook, KeyRefused, parse_expiry
from modelfleet.messages import admin
from modelfleet.messages.wire import RoutedKey, RoutedModel, RoutingSnapshot
from modelfleet.security.apikeys import hash_key
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore

from .awaited import Awaited
from .router_kit import FakeClock, client_of, keyed, run
from .test_admin_api import admin_client, control_plane

NOW = 1_800_000_000.0  # 2027-01-15, wall-clock seconds
MODELS = {m: m for m in ("small", "wide")}


def test_an_expiry_is_a_duration_or_a_date_and_never_in_the_past() -> None:
    assert parse_expiry("90s", NOW) == NOW + 90
    assert parse_expiry("12h", NOW) == NOW + 12 * 3600
    assert parse_expiry("30d", NOW) == NOW + 30 * 86400
    assert parse_expiry("2w", NOW) == NOW + 14 * 86400
    assert parse_expiry("2027-02-01", NOW) == datetime(2027, 2, 1, tzinfo=UTC).timestamp()
    assert (
        parse_expiry("2027-02-01T06:00:00+02:00", NOW)
        == datetime(2027, 2, 1, 4, tzinfo=UTC).timestamp()
    )
    for past in ("2020-01-01", "0s", "0d"):
        with pytest.raises(KeyRefused, match=r"past|not after now"):
            parse_expiry(past, NOW)
    with pytest.raises(KeyRefused, match="neither a duration"):
        parse_expiry("next tuesday", NOW)


def book_of(store: SqliteStore) -> Any:
    """A book on `store` as a control plane reads it, its changes run to their end."""
    return Awaited(KeyBook(StoreCalls(store, 5.0), store.api_keys()))


def test_a_key_is_stored_by_its_hash_and_kept_across_restarts(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "store.db")
    book = book_of(store)
    request = admin.KeyCreate(name="alice", models=["small"], rpm=60, expires="30d")
    key, stored = book.create(request, MODELS, NOW)
    assert key.startswith("mf-") and stored.sha256 == hash_key(key)
    assert stored.prefix == key[:11] and stored.expires_at == NOW + 30 * 86400
    assert key not in (tmp_path / "store.db").read_bytes().decode(errors="replace")
    store.close()
    again = book_of(SqliteStore(tmp_path / "store.db"))
    assert again.keys == {"alice": stored}
    [routed] = again.routed()
    assert routed == RoutedKey(
        name="alice", sha256=hash_key(key), models=["small"], rpm=60, expires_at=stored.expires_at
    )


def test_an_update_changes_what_it_names_and_clears_what_it_clears() -> None:
    book = book_of(SqliteStore(":memory:"))
    _, first = book.create(admin.KeyCreate(name="k", rpm=60, tpm=1000), MODELS, NOW)
    changed = book.update("k", admin.KeyUpdate(max_concurrent=4, clear=["rpm"]), MODELS, NOW)
    assert (changed.rpm, changed.tpm, changed.max_concurrent) == (None, 1000, 4)
    assert changed.sha256 == first.sha256 and changed.created_at == first.created_at
    later = book.update("k", admin.KeyUpdate(models=["wide"], expires="1d"), MODELS, NOW + 5)
    assert later.models == ("wide",) and later.expires_at == NOW + 5 + 86400
    assert (
        book.update("k", admin.KeyUpdate(clear=["models", "expires"]), MODELS, NOW).models is None
    )


@pytest.mark.usefixtures("way")
def test_bad_key_requests_are_refused_and_change_nothing() -> None:
    store = SqliteStore(":memory:")
    book = book_of(store)
    _, alice = book.create(admin.KeyCreate(name="alice", rpm=5), MODELS, NOW)
    refusals = [
        (409, "exists", lambda: book.create(admin.KeyCreate(name="alice"), MODELS, NOW)),
        (409, "not in the catalog", lambda: book.create(
            admin.KeyCreate(name="bob", models=["nope"]), MODELS, NOW)),
        (409, "past", lambda: book.create(
            admin.KeyCreate(name="bob", expires="2020-01-01"), MODELS, NOW)),
        (404, "no key named 'nope'", lambda: book.revoke("nope")),
        (404, "keys: alice", lambda: book.update("nope", admin.KeyUpdate(rpm=1), MODELS, NOW)),
        (400, "both set and cleared", lambda: book.update(
            "alice", admin.KeyUpdate(rpm=1, clear=["rpm"]), MODELS, NOW)),
        (409, "past", lambda: book.update(
            "alice", admin.KeyUpdate(rpm=1, expires="2020-01-01"), MODELS, NOW)),
    ]  # fmt: skip
    for status, message, call in refusals:
        with pytest.raises(KeyRefused, match=message) as refused:
            call()
        assert refused.value.status == status
    assert book.keys == {"alice": alice} and store.api_keys() == [alice]
    with pytest.raises(ValueError, match="greater than 0"):
        admin.KeyCreate(name="bob", rpm=0)
    with pytest.raises(ValueError, match="should match pattern"):
        admin.KeyCreate(name="no spaces please")


def test_a_key_made_through_the_admin_api_is_published_to_routers_and_revoked_from_them() -> None:
    cp = control_plane()

    async def go() -> None:
        async with admin_client(cp) as c:
            made = await c.post("/v1/keys", json={"name": "alice", "models": ["small"]})
            assert made.status_code == 200, made.text
            key = made.json()["key"]
            listed = (await c.get("/v1/keys")).json()["keys"]
            assert [k["name"] for k in listed] == ["alice"] and "key" not in listed[0]
            cp.publish()
            published = cp.publisher._body
            assert hash_key(key) in published and key not in published
            version = cp.publisher.version
            assert (await c.delete("/v1/keys/alice")).status_code == 200
            cp.publish()
            assert cp.publisher.version == version + 1
            assert hash_key(key) not in cp.publisher._body

    run(go())


@pytest.mark.usefixtures("way")
def test_the_router_takes_pushed_keys_beside_its_own_and_refuses_an_expired_one() -> None:
    wall = FakeClock()
    router = keyed(wall=wall)
    expires = wall.now + 60
    router.apply(
        RoutingSnapshot(
            epoch=1,
            version=1,
            models=[RoutedModel(name="m", endpoints=[]), RoutedModel(name="n", endpoints=[])],
            keys=[
                RoutedKey(name="pushed", sha256=hash_key("pushed-key"), models=["m"]),
                RoutedKey(name="brief", sha256=hash_key("brief-key"), expires_at=expires),
            ],
        )
    )

    async def go() -> None:
        async with client_of(router) as c:

            async def models(key: str) -> tuple[int, object]:
                r = await c.get("/v1/models", headers={"authorization": f"Bearer {key}"})
                body = r.json()
                return r.status_code, [m["id"] for m in body["data"]] if "data" in body else body

            assert await models("client-key") == (200, ["m", "n"])  # the config's own key
            assert await models("pushed-key") == (200, ["m"])
            assert await models("brief-key") == (200, ["m", "n"])
            wall.now = expires
            status, body = await models("brief-key")
            assert status == 401 and "(brief) has expired" in str(body)
            post = await c.post(
                "/v1/completions",
                json={"model": "m", "prompt": "x"},
                headers={"authorization": "Bearer brief-key"},
            )
            assert post.status_code == 401 and "has expired" in post.text
            assert (await models("unknown"))[0] == 401
        # The next table without the pushed key: refused from then on.
        router.apply(RoutingSnapshot(epoch=1, version=2, models=[]))
        async with client_of(router) as c:
            r = await c.get("/v1/models", headers={"authorization": "Bearer pushed-key"})
            assert r.status_code == 401
            r = await c.get("/v1/models")
            assert r.status_code == 200

    run(go())
