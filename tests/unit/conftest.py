"""Fixtures the unit tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from . import router_kit


@pytest.fixture(params=["proxy", "lane"])
def way(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test both ways a request reaches a router: through the ASGI app (a task per
    request), and through the lean server, which hands it to the proxy by a callback
    (`router_kit.WAY`)."""
    router_kit.WAY = request.param
    try:
        yield request.param
    finally:
        router_kit.WAY = "proxy"


@pytest.fixture(autouse=True, scope="package")
def away_from_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run in a folder of the session's own: a control plane built with the default state
    dir writes its instance id there, and the unit tests once left one in the checkout,
    where it was committed. For the whole package, as Hypothesis refuses per-test fixtures."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)
