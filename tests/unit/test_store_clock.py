"""Times a control plane writes for another to check (key expiries, join tokens) are taken by
the store's clock, the one every control plane on the store shares. Issue 38: with host clocks
120 s apart, a join token made on one was "expired" on the next leader right after a
failover."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

import yaml

from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.security.pki import CertificateAuthority
from modelfleet.store.sqlite import SqliteStore

from .test_admin_api import TOKEN, admin_client
from .test_controlplane import FakeClock


def start(folder: Path, name: str, clock: FakeClock, ca: CertificateAuthority) -> ControlPlane:
    catalogs = CatalogKeeper(SqliteStore(folder / "store.sqlite"))
    if not catalogs.has_catalog:
        catalogs.lead(clock.time())
        catalogs.apply(yaml.safe_dump({"models": []}), "api", clock.time())
    settings = ControlPlaneConfig(admin_token=TOKEN, state_dir=folder / name, lease_ttl=3.0)
    return ControlPlane(settings, catalogs, clock=clock, ca=ca)


def test_expiries_are_written_and_read_by_the_stores_clock_not_the_hosts(tmp_path: Path) -> None:
    ca = CertificateAuthority.create("test CA", datetime.datetime.now(datetime.UTC))
    behind = FakeClock(wall=time.time() - 60, mono=100.0)  # SQLite's clock is this host's
    ahead = FakeClock(wall=time.time() + 60, mono=5000.0)
    first = start(tmp_path, "a", behind, ca)
    second = start(tmp_path, "b", ahead, ca)
    assert first.acting() and not second.acting()

    async def go() -> None:
        async with admin_client(first) as a:
            made = await a.post("/v1/join-tokens", json={"ttl": "30s"})
            assert made.status_code == 200, made.text
            key = await a.post("/v1/keys", json={"name": "k", "expires": "1h"})
            assert key.status_code == 200, key.text
        # By the store's clock the token has about 30 s left, whoever reads it: by the
        # second's own clock (60 s ahead) it would have run out.
        assert abs(made.json()["expires_at"] - (time.time() + 30)) < 10
        assert abs(key.json()["expires_at"] - (time.time() + 3600)) < 10
        async with admin_client(second) as b:  # a follower answers what the store holds
            [listed] = (await b.get("/v1/join-tokens")).json()["tokens"]
        assert listed["state"] == "usable", listed

    asyncio.run(go())
