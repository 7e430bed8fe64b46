"""Fixtures the unit tests share."""

from __future__ import annotations

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
