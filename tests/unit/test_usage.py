"""Usage per key, model and hour: the router's ledger, the store that counts each batch once,
and the control plane collecting from a router in front of a real simulator."""

from __future__ import annotations

import httpx
import pytest

from modelfleet.controlplane.config import RouterTarget
from modelfleet.controlplane.series import Recorder, Totals
from modelfleet.controlplane.usage import UsageCollector
from modelfleet.messages.wire import RoutedModel, RoutingSnapshot
from modelfleet.router.service import create_apps
from modelfleet.router.usage import Usage, UsageLedger
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app as create_simulator
from modelfleet.store import StoredUsage
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore

from .router_kit import FakeClock, client_of, keyed, run, serving

HOUR = 1_800_000_000 // 3600 * 3600


def test_a_batch_is_sent_until_it_is_acknowledged_and_then_forgotten() -> None:
    ledger = UsageLedger(run="r1")
    assert ledger.take() is None
    ledger.count("alice", "m", HOUR + 5, Usage(10, 3), status=200)
    ledger.count("alice", "m", HOUR + 6, None, status=500)
    ledger.count("alice", "m", HOUR + 7, None, status=429)  # over its limit
    ledger.count("alice", "m", HOUR + 3600, Usage(1, 1), status=200)  # the next hour
    first = ledger.take()
    assert first is not None and first.batch == 1
    rows = {(r.hour, r.requests, r.prompt_tokens, r.completion_tokens, r.errors, r.limited)
            for r in first.rows}  # fmt: skip
    assert rows == {(HOUR, 3, 10, 3, 2, 1), (HOUR + 3600, 1, 1, 1, 0, 0)}
    ledger.count("bob", "m", HOUR + 7, Usage(2, 2), status=200)
    assert ledger.take() == first  # not acknowledged: the same batch again
    assert not ledger.ack("r1", 2) and not ledger.ack("other-run", 1)
    assert ledger.ack("r1", 1)
    second = ledger.take()
    assert second is not None and second.batch == 2 and [r.key for r in second.rows] == ["bob"]


def test_the_store_counts_each_batch_once_and_sums_batches_of_one_hour() -> None:
    store = SqliteStore(":memory:")
    row = StoredUsage("alice", "m", HOUR, 2, 10, 3, 1, HOUR + 6.0)
    assert store.add_usage("r1", 1, [row], now=HOUR + 10)
    assert not store.add_usage("r1", 1, [row], now=HOUR + 11)  # resent: counted once
    later = StoredUsage("alice", "m", HOUR, 1, 5, 5, 0, HOUR + 9.0)
    assert store.add_usage("r2", 1, [later, StoredUsage("bob", "n", HOUR + 3600, 1, 1, 1, 0, 0)],
                           now=HOUR + 12)  # fmt: skip
    assert store.usage("alice") == [StoredUsage("alice", "m", HOUR, 3, 15, 8, 1, HOUR + 9.0)]
    assert [u.key for u in store.usage(model="n")] == ["bob"]
    assert [u.key for u in store.usage(since=HOUR + 3600)] == ["bob"]
    assert len(store.usage()) == 2
    assert store.usage_totals() == {"alice": (3, 23, HOUR + 9.0), "bob": (1, 2, 0.0)}


@pytest.mark.usefixtures("way")
def test_the_control_plane_collects_what_the_router_counted_from_the_engines_usage() -> None:
    """Through a router in front of the simulator: a whole answer and a stream whose client
    did not ask for usage. The collected tokens are what the engine reported; a collection
    whose acknowledgement was lost is sent again and stored once."""
    wall = FakeClock()
    wall.now = HOUR + 100.0

    async def go() -> None:
        async with serving(create_simulator(SimSettings(model="m", ttft=0, itl=0))) as engine:
            router = keyed(wall=wall, push_token="push-token-123")
            models = [RoutedModel(name="m", endpoints=[engine])]
            assert router.apply(RoutingSnapshot(epoch=1, version=1, models=models))
            seen = []
            async with client_of(router) as c:
                whole = await c.post("/v1/completions", json={"model": "m", "prompt": "a b c",
                                                              "max_tokens": 4})  # fmt: skip
                seen.append(whole.json()["usage"])
                streamed = await c.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": "d e", "max_tokens": 3, "stream": True},
                )
                assert '"usage": {' not in streamed.text and '"usage":{' not in streamed.text
                refused = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
                assert refused.status_code == 404

            _, push_app = create_apps(router)
            acks_to_lose = 1

            async def to_router(request: httpx.Request) -> httpx.Response:
                nonlocal acks_to_lose
                if request.url.path.endswith("/ack") and acks_to_lose:
                    acks_to_lose -= 1
                    raise httpx.ConnectError("lost on the way")
                transport = httpx.ASGITransport(app=push_app)
                return await transport.handle_async_request(request)

            store = SqliteStore(":memory:")
            calls = StoreCalls(store, 5.0)
            recorder = Recorder(10, calls, lambda: wall.now)
            async with httpx.AsyncClient(transport=httpx.MockTransport(to_router)) as http:
                target = RouterTarget(url="http://router", token="push-token-123")
                collector = UsageCollector([target], http, calls, 1.0, lambda: wall.now, recorder)
                await collector.collect()  # stored; its acknowledgement is lost
                await collector.collect()  # sent again: stored once, acknowledged
                await collector.collect()  # nothing new
            wall.now += 10
            await recorder.write()
            # The key's plot counts each request once, though its batch was sent twice.
            [point] = store.points("key", "k", 10, 0)
            plotted = Totals.loads(point.body)
            assert (plotted.count("requests"), plotted.count("errors")) == (3, 1)
            [row] = store.usage(model="m")
            assert (row.key, row.model, row.hour, row.requests, row.errors) == ("k", "m", HOUR,
                                                                                2, 0)  # fmt: skip
            # The stream's usage is the simulator's: 3 completion tokens, its prompt's tokens.
            assert row.completion_tokens == seen[0]["completion_tokens"] + 3
            assert row.prompt_tokens > seen[0]["prompt_tokens"]
            # A model the table does not know is counted under "-", not under its name.
            assert store.usage(model="nope") == []
            refused_rows = store.usage(model="-")
            assert [(u.requests, u.errors) for u in refused_rows] == [(1, 1)]

    run(go())
