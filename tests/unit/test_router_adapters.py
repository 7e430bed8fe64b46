"""LoRA adapters at the router: routed only to the replicas holding them, `base:adapter` as an
alias, listed with their base, named in keys' allowlists, held while loaded nowhere (the
control plane told at once), and refused with the engine's words when they failed to load."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelfleet.messages.wire import RoutedModel, RoutingSnapshot
from modelfleet.router.rates import Rates
from modelfleet.router.service import Router

from .router_kit import client_of, keyed, run, serving, until


class Engines:
    """Engines on 127.0.0.1 that note which model each request named."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str]] = []  # (engine index, model)
        self.gone: set[tuple[int, str]] = set()  # (engine index, adapter) it answers 404 for

    @contextlib.asynccontextmanager
    async def serve(self, count: int) -> AsyncIterator[list[str]]:
        async with contextlib.AsyncExitStack() as stack:
            yield [await stack.enter_async_context(serving(self._app(i))) for i in range(count)]

    def _app(self, index: int) -> Starlette:
        async def complete(request: Request) -> Response:
            model = (await request.json())["model"]
            self.got.append((index, model))
            if (index, model) in self.gone:
                return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
            return JSONResponse({"model": model, "choices": [{"index": 0, "text": "ok"}]})

        return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


def table(
    version: int, urls: list[str], holders: dict[str, list[int]], cold_timeout: float = 30.0
) -> RoutingSnapshot:
    model = RoutedModel(
        name="base",
        endpoints=urls,
        replicas={u: f"r{i}" for i, u in enumerate(urls)},
        cold_timeout=cold_timeout,
        adapters={name: [urls[i] for i in where] for name, where in holders.items()},
        adapter_errors={"bad": "Loading lora bad failed: No adapter found for /x"},
    )
    return RoutingSnapshot(epoch=1, version=version, models=[model])


def ask(model: str) -> dict[str, str]:
    return {"model": model, "prompt": "p"}


def test_adapters_are_routed_to_their_holders_listed_allowed_held_and_refused(way: str) -> None:
    async def main() -> None:
        router = keyed(
            push_token="push",
            api_keys=[
                {"name": "k", "key": "client-key"},
                {"name": "only-x", "key": "x-key", "models": ["x"]},
            ],
        )
        engines = Engines()
        async with client_of(router) as client, engines.serve(2) as urls:
            assert router.apply(table(1, urls, {"x": [1], "y": [], "bad": []}))
            for model in ("x", "x", "base:x"):
                answer = await client.post("/v1/completions", json=ask(model))
                assert answer.status_code == 200, answer.text
            assert engines.got == [(1, "x")] * 3  # the holder only; the alias sent as "x"

            listed = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m.get("parent") for m in listed} == {
                "base": None, "x": "base", "y": "base", "bad": "base"}  # fmt: skip
            only_x = {"authorization": "Bearer x-key"}
            listed = (await client.get("/v1/models", headers=only_x)).json()["data"]
            assert [m["id"] for m in listed] == ["x"]
            refused = await client.post("/v1/completions", json=ask("y"), headers=only_x)
            assert refused.status_code == 404
            allowed = await client.post("/v1/completions", json=ask("base:x"), headers=only_x)
            assert allowed.status_code == 200

            failed = await client.post("/v1/completions", json=ask("bad"))
            assert failed.status_code == 503
            assert failed.headers["x-modelfleet-reason"] == "adapter-failed"
            assert "No adapter found for /x" in failed.json()["error"]["message"]
            unknown = await client.post("/v1/completions", json=ask("other:x"))
            assert unknown.status_code == 404  # not x's base: no alias

            # Loaded nowhere: held, the control plane's long poll told at once, and sent on
            # once a new table says where it is loaded.
            poll = asyncio.create_task(router.load(wait=10))
            held = asyncio.create_task(client.post("/v1/completions", json=ask("y")))
            await until("the request for y held", lambda: router.cold.waiting == 1)
            report = await asyncio.wait_for(poll, 2)
            assert report.models["y"].held == 1 and report.models["y"].in_flight == 0
            # And how long it has waited, which grows while it is held.
            assert 0 <= report.models["y"].waited < router.load_now().models["y"].waited < 5
            assert not held.done()
            assert router.apply(table(2, urls, {"x": [1], "y": [0], "bad": []}))
            answer = await asyncio.wait_for(held, 5)
            assert answer.status_code == 200 and engines.got[-1] == (0, "y")
        await router.close()

    run(main())


def test_a_held_adapter_request_past_its_time_is_refused_as_adapter_loading(way: str) -> None:
    async def main() -> None:
        router: Router = keyed(push_token="push")
        assert router.apply(table(1, ["http://127.0.0.1:9"], {"y": []}, cold_timeout=0.3))
        async with client_of(router) as client:
            answer = await client.post("/v1/completions", json=ask("y"))
            assert answer.status_code == 503
            assert answer.headers["x-modelfleet-reason"] == "adapter-loading"
            assert "Adapter `y` was loaded on no replica within 0.3 s" in answer.text
        await router.close()

    run(main())


def test_requests_held_for_an_adapter_that_then_fails_to_load_are_refused_with_why(
    way: str,
) -> None:
    async def main() -> None:
        router = keyed(push_token="push")
        snapshot = table(1, ["http://127.0.0.1:9"], {"bad": []})
        quiet = snapshot.models[0].model_copy(update={"adapter_errors": {}})
        assert router.apply(snapshot.model_copy(update={"models": [quiet]}))
        async with client_of(router) as client:
            held = asyncio.create_task(client.post("/v1/completions", json=ask("bad")))
            await until("the request for bad held", lambda: router.cold.waiting == 1)
            assert router.apply(table(2, ["http://127.0.0.1:9"], {"bad": []}))  # bad failed
            answer = await asyncio.wait_for(held, 5)
            assert answer.status_code == 503
            assert answer.headers["x-modelfleet-reason"] == "adapter-failed"
            assert "No adapter found for /x" in answer.json()["error"]["message"]
            assert router.cold.waiting == 0
            page = (await router.metrics_text()).decode()
            assert 'modelfleet_router_held_total{model="bad"} 1.0' in page
        await router.close()

    run(main())


def test_how_often_each_adapter_is_asked_fades() -> None:
    rates = Rates(fade=10.0)
    for at in range(10):
        rates.note("a", float(at))
    now = rates.rates(9.0)
    # Ten requests over ten seconds, each faded by its age: about 2/3 of one a second.
    assert now["a"] == pytest.approx(sum(math.exp(-age / 10) for age in range(10)) / 10)
    assert rates.rates(39.0)["a"] < now["a"] * 0.06  # 30 s later: e^-3 of it
    assert rates.rates(200.0) == {}  # faded to nothing: forgotten


def test_an_engine_that_let_the_adapter_go_sends_the_request_on_not_the_404(way: str) -> None:
    async def main() -> None:
        router = keyed(push_token="push")
        engines = Engines()
        async with client_of(router) as client, engines.serve(2) as urls:
            engines.gone = {(1, "x")}
            # Its table still lists engine 1 for x: the request goes on to engine 0.
            assert router.apply(table(1, urls, {"x": [1, 0]}))
            # Which engine a request tries first is the balancer's pick among equals: requests
            # go on until one tried engine 1 first (four in a row once missed it, 1 in 16).
            answers = []
            while (1, "x") not in engines.got:
                assert len(answers) < 60, "no request was ever sent to engine 1 first"
                answers.append(await client.post("/v1/completions", json=ask("x")))
            assert [a.status_code for a in answers] == [200] * len(answers)
            assert engines.got.count((0, "x")) == len(answers)  # each answered by engine 0
            page = (await router.metrics_text()).decode()
            resent = engines.got.count((1, "x"))
            assert f'modelfleet_router_retries_total{{model="x"}} {resent}.0' in page

            # Only engine 1 listed: held until a table says where x is, then sent there.
            assert router.apply(table(2, urls, {"x": [1]}))
            engines.got.clear()
            held = asyncio.create_task(client.post("/v1/completions", json=ask("x")))
            await until("the request held again", lambda: router.cold.waiting == 1)
            assert engines.got == [(1, "x")]
            assert router.apply(table(3, urls, {"x": [0]}))
            answer = await asyncio.wait_for(held, 5)
            assert answer.status_code == 200 and engines.got[-1] == (0, "x")

            # Held after engine 1's 404, then x is loaded on engine 1 again (the replica with
            # room): the request goes back to it, though it was the one that said 404.
            assert router.apply(table(4, urls, {"x": [1]}))
            engines.got.clear()
            held = asyncio.create_task(client.post("/v1/completions", json=ask("x")))
            await until("the request held after engine 1's 404", lambda: router.cold.waiting == 1)
            engines.gone = set()
            assert router.apply(table(5, urls, {"x": [1]}))
            answer = await asyncio.wait_for(held, 5)
            assert answer.status_code == 200, answer.text
            assert engines.got == [(1, "x"), (1, "x")]

            # A model's own 404 is the client's: nothing is retried for it.
            engines.gone = {(0, "base"), (1, "base")}
            plain = await client.post("/v1/completions", json=ask("base"))
            assert plain.status_code == 404
        await router.close()

    run(main())


def test_a_router_with_workers_reports_the_sum_of_their_held_requests_and_rates() -> None:
    from modelfleet.messages.wire import LoadReport, ModelLoad
    from modelfleet.router.workers import _summed_loads

    one = LoadReport(models={"x": ModelLoad(held=1, rate=0.5, waited=4.0)})
    two = LoadReport(
        models={"x": ModelLoad(held=2, rate=0.25, waited=1.0), "y": ModelLoad(rate=1.0)}
    )
    summed = _summed_loads([one, two]).models
    assert (summed["x"].held, summed["x"].rate, summed["y"].rate) == (3, 0.75, 1.0)
    assert summed["x"].waited == 4.0  # the oldest held request of any worker


def test_a_router_with_workers_reports_every_engine_reading_of_its_workers() -> None:
    """Issue 57: with `workers: 2` the replica page never showed KV cache use: the workers'
    loads were summed field by field, and the cache was left out."""
    from modelfleet.messages.wire import LoadReport, ModelLoad
    from modelfleet.router.workers import _summed_loads

    full = ModelLoad(in_flight=2, held=1, engines=5, replicas={"r": (2, 5)}, cache={"r": 0.25},
                     rate=0.5, waited=1.0)  # fmt: skip
    assert set(full.model_fields_set) == set(ModelLoad.model_fields)  # every field said
    assert _summed_loads([LoadReport(models={"x": full})]).models["x"] == full
    # Both workers read the same engine: the largest reading of its queue and cache is kept.
    other = ModelLoad(in_flight=1, engines=7, replicas={"r": (1, 7)}, cache={"r": 0.5})
    both = _summed_loads([LoadReport(models={"x": full}), LoadReport(models={"x": other})])
    assert both.models["x"].replicas == {"r": (3, 7)} and both.models["x"].engines == 7
    assert both.models["x"].cache == {"r": 0.5}
