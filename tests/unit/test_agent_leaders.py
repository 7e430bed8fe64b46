"""An agent among several control planes: it asks them all who leads and goes straight to the
leader, past one that does not answer; it follows a follower's redirect to the leader at once,
and refuses an answer of a lease epoch lower than one it has taken (a leader that lost its
lease and does not know yet)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.agent.service import Agent
from modelfleet.agent.settings import AgentSettings
from modelfleet.agent.uplink import Beat
from modelfleet.messages.wire import AgentReport, LeaderAnswer, NodeAssignment, NodeUse


def base_of(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}:{request.url.port}"


def test_a_redirect_is_followed_at_once_and_an_older_epoch_is_refused(tmp_path: Path) -> None:
    seen: list[str] = []
    leader = ["http://b:7070"]
    epochs = {"http://b:7070": [3, 2], "http://c:7070": [4]}

    def answer(request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        assert request.headers["authorization"] == "Bearer t"
        if request.url.path == "/v1/leader":  # control planes that do not say who leads
            return httpx.Response(404, json={"error": "not found"})
        seen.append(base)
        if base == "http://a:7070":  # a follower: the leader is b
            return httpx.Response(
                307, json={"error": "follows"}, headers={"location": f"{leader[0]}/v1/report"}
            )
        epoch = epochs[base].pop(0)
        made = NodeAssignment(node="n1", shards=[], version="v", epoch=epoch)
        return httpx.Response(200, content=made.model_dump_json())

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="t",
        state_dir=tmp_path,
        control_planes=("http://a:7070", "http://c:7070"),
        transport=httpx.MockTransport(answer),
    )

    async def exchange() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            report = agent.report()
            assert isinstance(report, AgentReport)
            first = await agent.link.send_report(report)
            assert first is not None and first.epoch == 3
            assert seen == ["http://a:7070", "http://b:7070"]  # redirected, sent again at once
            assert agent.link.control_plane == "http://b:7070" and agent.link.epoch == 3
            # b answers again under epoch 2, older than the 3 taken: refused, and the agent
            # goes on (none says who leads) to the next control plane, which names the leader
            # now, c.
            assert await agent.link.send_report(agent.report()) is None
            assert agent.link.epoch == 3
            leader[0] = "http://c:7070"
            later = await agent.link.send_report(agent.report())
            assert later is not None and later.epoch == 4 and agent.link.epoch == 4
            assert seen[-3:] == ["http://b:7070", "http://a:7070", "http://c:7070"]

    asyncio.run(exchange())


def leader_said(base: str, leads: str, epoch: int) -> httpx.Response:
    """`base`'s answer to "who leads?" when `leads` leads under `epoch`."""
    said = LeaderAnswer(leading=base == leads, epoch=epoch, leader="x", leader_url=leads)
    return httpx.Response(200, content=said.model_dump_json())


def test_an_agent_asks_who_leads_when_it_cannot_reach_its_control_plane(tmp_path: Path) -> None:
    """A leader killed -9: its agents waited a retry before trying another control plane, and
    the new leader's first pass waited for them. Now the agent asks every control plane at
    once who leads and goes there; with none reachable it tries each once, then gives up this
    try (and waits, as before)."""
    seen: list[str] = []
    down = {"http://a:7070"}
    leads = ["http://b:7070"]

    def answer(request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        if base in down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/leader":
            return leader_said(base, leads[0], 5)
        seen.append(f"{request.url.path} {base}")
        if request.url.path == "/v1/heartbeat":
            return httpx.Response(409, json={"error": "send the whole report"})
        made = NodeAssignment(node="n1", shards=[], version="v", epoch=5)
        return httpx.Response(200, content=made.model_dump_json())

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="t",
        state_dir=tmp_path,
        control_planes=("http://a:7070", "http://b:7070", "http://c:7070"),
        transport=httpx.MockTransport(answer),
    )

    async def exchange() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            taken = await agent.link.send_report(agent.report())
            assert taken is not None and taken.epoch == 5
            assert seen == ["/v1/report http://b:7070"]  # straight to the leader
            # A heartbeat that cannot reach its control plane: the whole report, to the one
            # that leads now.
            down.add("http://b:7070")
            leads[0] = "http://c:7070"
            seen.clear()
            beat = await agent.link.send_heartbeat(2, taken, NodeUse(memory_used=0, memory_total=1))
            assert beat is Beat.REPORT
            assert await agent.link.send_report(agent.report()) is not None
            assert agent.link.control_plane == "http://c:7070"
            # None reachable: each tried once, then this try is given up.
            down.add("http://c:7070")
            seen.clear()
            assert await agent.link.send_report(agent.report()) is None
            assert seen == []

    asyncio.run(exchange())


def test_an_agent_goes_straight_to_the_leader_past_a_frozen_control_plane(
    tmp_path: Path,
) -> None:
    """Issue 57: agents bounced between stale control planes and never tried the one holding
    the lease. The agent asks every one who leads (a frozen one costs ASK_S) and sends its
    report to the one that leads under the newest epoch, never to one that does not answer,
    nor to the stale leader a follower still names."""
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        if base == "http://a:7070":  # frozen: the connection is made, nothing answers
            raise httpx.ReadTimeout("no answer", request=request)
        if request.url.path == "/v1/leader":  # b's view is stale: it names a (epoch 1)
            return leader_said(base, "http://a:7070", 1) if base == "http://b:7070" else (
                leader_said(base, "http://c:7070", 2))  # fmt: skip
        seen.append(f"{request.url.path} {base}")
        made = NodeAssignment(node="n1", shards=[], version="v", epoch=2)
        return httpx.Response(200, content=made.model_dump_json())

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="t",
        state_dir=tmp_path,
        control_planes=("http://a:7070", "http://b:7070", "http://c:7070"),
        transport=httpx.MockTransport(answer),
    )

    async def exchange() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            taken = await agent.link.send_report(agent.report())
            assert taken is not None and taken.epoch == 2
            assert seen == ["/v1/report http://c:7070"]

    asyncio.run(exchange())


def test_an_agent_of_one_control_plane_waits_instead_of_trying_again_at_once(
    tmp_path: Path,
) -> None:
    tries: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        tries.append(request.url.path)
        raise httpx.ConnectError("connection refused", request=request)

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="t",
        state_dir=tmp_path,
        transport=httpx.MockTransport(answer),
    )

    async def exchange() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            assert await agent.link.send_report(agent.report()) is None
            held = NodeAssignment(node="n1", shards=[], version="v")
            use = NodeUse(memory_used=0, memory_total=1)
            assert await agent.link.send_heartbeat(2, held, use) is Beat.FAILED
            assert tries == ["/v1/report", "/v1/heartbeat"]

    asyncio.run(exchange())


def test_an_agent_whose_leader_stands_in_for_its_store_asks_who_leads_before_each_exchange(
    tmp_path: Path,
) -> None:
    """A leader whose store is down answers its agents (it may start a cold model), saying
    it stands in: it holds no lease it can renew, and another may have taken it. The agent
    asks who leads before its next exchange, and goes to one that leads under a newer
    epoch."""
    asked: list[str] = []
    newer = [False]

    def answer(request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        if request.url.path == "/v1/leader":
            asked.append(base)
            if newer[0]:
                return leader_said(base, "http://b:7070", 4)
            return leader_said(base, "http://a:7070", 3)
        epoch = 3 if base == "http://a:7070" else 4
        made = NodeAssignment(node="n1", shards=[], version="v", epoch=epoch)
        headers = {"x-modelfleet-standing-in": "1"} if base == "http://a:7070" else {}
        return httpx.Response(200, content=made.model_dump_json(), headers=headers)

    settings = AgentSettings(
        control_plane="http://a:7070",
        node="n1",
        token="t",
        state_dir=tmp_path,
        control_planes=("http://a:7070", "http://b:7070"),
        transport=httpx.MockTransport(answer),
    )

    async def exchange() -> None:
        async with Agent(settings, SimulatedGpus("1x80GB")) as agent:
            assert await agent.link.send_report(agent.report()) is not None
            assert len(asked) == 2 and agent.link.control_plane == "http://a:7070"
            newer[0] = True  # b took the lease meanwhile
            taken = await agent.link.send_report(agent.report())
            assert len(asked) == 4 and agent.link.control_plane == "http://b:7070"
            assert taken is not None and taken.epoch == 4
            assert await agent.link.send_report(agent.report()) is not None
            assert len(asked) == 4  # b does not stand in: nobody asked

    asyncio.run(exchange())
