"""The nemesis (tests/integration/nemesis.py) against a fleet of three control planes on a
PostgreSQL of its own, as `modelfleet up --control-planes 3 --store postgres` starts it, for a
minute under a fixed seed (MODELFLEET_NEMESIS_SEED and MODELFLEET_NEMESIS_S choose another
seed and length; `python bench/ha.py` runs it for minutes)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from modelfleet.http.loadgen import SteadyClient

from .conftest import fleet_of, wait_for
from .nemesis import A, Nemesis


def test_a_nemesis_of_kills_freezes_and_store_outages_breaks_no_promise() -> None:
    seed = int(os.environ.get("MODELFLEET_NEMESIS_SEED", "38"))
    seconds = float(os.environ.get("MODELFLEET_NEMESIS_S", "60"))
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-nemesis-"))
    os.chmod(folder, 0o711)  # run as root, the server runs as `postgres`, which must enter
    try:
        with fleet_of(
            folder,
            [A],
            control_planes=3,
            store="postgres",
            report_interval=1.0,
            control_plane={"lease_ttl": 3.0, "settle_for": 10},
        ) as fleet:
            client = SteadyClient(fleet.router_url, fleet.api_key, "a", workers=2, pace=5.0)
            client.start()
            try:
                wait_for("the first requests answered", lambda: client.ok >= 5, 60)
                # Before the replicas were ready, requests got 503 "no replica is ready
                # now": the fleet's start, not the nemesis.
                failed_before = len(client.failures)
                nemesis = Nemesis(fleet, seed)
                nemesis.run(seconds)
                violations = nemesis.check()
            finally:
                client.stop()
            schedule = "\n".join(nemesis.done)
            assert not violations, f"{violations}\nschedule:\n{schedule}"
            # Nothing on the data path was killed: no client request may fail.
            failed = client.failures[failed_before:]
            assert not failed, f"{failed}\nschedule:\n{schedule}"
            assert len(nemesis.done) >= seconds / 3, schedule  # it did act
    finally:
        shutil.rmtree(folder, ignore_errors=True)
