"""Failed tries per source address, slowed down (`throttle.py`), and the control plane's two
doors that take a secret from anyone: the join exchange and the dashboard's sign-in."""

from __future__ import annotations

import asyncio
import datetime

import httpx
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.dashboard import Dashboard
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.core.throttle import Throttle
from modelfleet.messages.wire import JoinRequest
from modelfleet.security.joining import JoinToken
from modelfleet.security.pki import CertificateAuthority, request
from modelfleet.store.sqlite import SqliteStore

from .test_controlplane import TOKEN, FakeClock


def test_an_address_fails_freely_three_times_then_waits_twice_as_long_each_time() -> None:
    t = Throttle(free=3, base=1.0, cap=8.0)
    assert [t.failed("a", 0.0).wait for _ in range(3)] == [0.0, 0.0, 1.0]
    assert t.check("a", 0.5).wait == 0.5 and t.check("b", 0.5).wait == 0  # others are not slowed
    assert t.check("a", 0.6).refused_before == 2  # counted, for the log
    assert t.failed("a", 1.0).refused_before == 2  # said with the next failure, then reset
    assert [t.failed("a", 1.0).wait for _ in range(4)] == [4.0, 8.0, 8.0, 8.0]  # capped
    t.succeeded("a")
    assert t.check("a", 1.0).wait == 0 and t.failed("a", 1.0).wait == 0


def test_an_address_is_forgotten_after_a_quiet_while_and_memory_is_bounded() -> None:
    t = Throttle(free=1, forget_after=100.0, max_addresses=3)
    assert t.failed("a", 0.0).wait == 1.0
    assert t.failed("a", 200.0).wait == 1.0  # forgotten: a first failure again
    for address in ("b", "c", "d", "e"):
        t.failed(address, 300.0)
    assert len(t._seen) == 3 and "a" not in t._seen and "b" not in t._seen


@given(st.lists(st.sampled_from(["fail", "check", "ok"]), max_size=40))
def test_no_try_is_refused_before_the_free_failures_are_spent(steps: list[str]) -> None:
    t = Throttle(free=3)
    failures, now = 0, 0.0
    for step in steps:
        now += 0.01
        if step == "fail":
            failures += 1
            assert (t.failed("a", now).wait > 0) == (failures >= 3)
        elif step == "ok":
            failures = 0
            t.succeeded("a")
        else:
            assert (t.check("a", now).wait > 0) <= (failures >= 3)


def a_control_plane(clock: FakeClock) -> ControlPlane:
    store = SqliteStore(":memory:")
    keeper = CatalogKeeper(store)
    keeper.lead(0.0)
    keeper.apply("models: []\n", "api", 0.0)
    ca = CertificateAuthority.create("test", datetime.datetime.now(datetime.UTC))
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1)
    return ControlPlane(config, keeper, clock=clock, ca=ca)


def test_failed_joins_from_one_address_are_slowed_and_counted() -> None:
    """Issue 39: the join exchange took guesses without end, a log line each. Past three
    failures an address waits; what it tries meanwhile is refused unheard and counted."""
    clock = FakeClock(1_800_000_000.0, 100.0)
    cp = a_control_plane(clock)
    agent_app, _ = create_apps(cp)
    _, csr = request(["127.0.0.1"])
    body = JoinRequest(node="guess", csr=csr.decode()).model_dump_json()
    guess = str(JoinToken("0" * 12, "0" * 32, cp.ca.fingerprint if cp.ca else ""))

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=agent_app, client=("203.0.113.9", 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as c:
            headers = {"authorization": f"Bearer {guess}"}
            return [await c.post("/v1/join", content=body, headers=headers) for _ in range(20)]

    answers = asyncio.run(go())
    assert [a.status_code for a in answers[:3]] == [401, 401, 401]
    assert {a.status_code for a in answers[3:]} == {429}
    assert answers[3].headers["retry-after"] == "1"
    assert "too many failed joins from 203.0.113.9" in answers[3].json()["error"]
    assert cp.metrics.throttled.labels("join")._value.get() == 17
    clock.advance(1.0)  # its wait is over: the next try is heard
    assert asyncio.run(go())[0].status_code == 401


def test_failed_sign_ins_wait_longer_each_time() -> None:
    clock = FakeClock(1_800_000_000.0, 100.0)
    cp = a_control_plane(clock)
    _, admin_app = create_apps(cp, Dashboard(cp))

    async def sign_in(token: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=admin_app, client=("203.0.113.9", 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as c:
            return await c.post("/ui/login", data={"token": token})

    codes = [asyncio.run(sign_in("nope")).status_code for _ in range(4)]
    assert codes == [401, 401, 401, 429]
    refused = asyncio.run(sign_in(TOKEN))  # even the right token waits: it is not heard
    assert refused.status_code == 429 and "try again in 1 s" in refused.text
    clock.advance(1.0)
    assert asyncio.run(sign_in(TOKEN)).status_code == 303
    assert asyncio.run(sign_in("nope")).status_code == 401  # a success forgot the address
