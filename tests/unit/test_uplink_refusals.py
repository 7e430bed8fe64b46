"""How an agent takes a control plane's refusal of its reports (`agent/uplink.py`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from modelfleet.agent.credential import HeldToken
from modelfleet.agent.settings import AgentSettings
from modelfleet.agent.uplink import Uplink
from modelfleet.messages.wire import AgentReport

WHY = "node b advertises '127.0.0.1' for its engines, but may advertise only 10.0.0.7 (...)"


def test_a_report_refused_for_its_address_is_said_once_and_tried_less_often(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A joined node advertising an address it may not is refused (403) on every report:
    the agent says why once, waits longer after each refusal as after a 401, and does not
    join anew (its credential is good; a join would be refused as a name taken)."""
    tried: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        tried.append(request.url.path)
        return httpx.Response(403, json={"error": WHY})

    held = HeldToken("mfjoin.0123456789ab." + "1" * 32 + "." + "2" * 64, (), {})
    settings = AgentSettings(
        control_plane="http://a:7070",
        node="b",
        token="mfnode.kept",
        state_dir=tmp_path,
        report_interval=0.001,
        transport=httpx.MockTransport(answer),
        join_token=held,
    )
    report = AgentReport(node="b", boot_id="x", seq=1, address="127.0.0.1", gpus=[], shards=[])

    async def exchange() -> Uplink:
        link = Uplink(settings, "x", asyncio.Event())
        for _ in range(3):
            assert await link.send_report(report) is None
        await link.aclose()
        return link

    with caplog.at_level(logging.INFO, logger="modelfleet.agent"):
        link = asyncio.run(exchange())
    said = [r.getMessage() for r in caplog.records]
    assert sum(WHY in line for line in said) == 1, said
    assert link._refusals == 3  # each wait longer than the one before
    assert tried == ["/v1/report"] * 3 and not any("join" in line for line in said), said
    assert held.token is not None  # not taken: the credential was not accepted
