"""The agent's adapter sync against the simulator in-process: loads what is wanted, unloads
what is not, reports a refused load with the engine's words, loads everything again into a
new engine, and asks nothing of an engine that is not serving."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from modelfleet.agent.adapters import AdapterSync, EngineAt
from modelfleet.engines.base import AdapterApi
from modelfleet.engines.sglang import SglangDriver
from modelfleet.engines.vllm import VllmDriver
from modelfleet.messages.wire import AdapterState
from modelfleet.simulator.engine import SimSettings
from modelfleet.simulator.server import create_app


def sim() -> httpx.AsyncClient:
    settings = SimSettings(model="base", ttft=0.0, itl=0.0, enable_lora=True, max_loras=4,
                           lora_load_delay=0.02)  # fmt: skip
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(settings)), base_url="http://sim"
    )


async def until(what: str, check: Callable[[], Any], timeout: float = 5) -> None:
    print("UNTIL", what, flush=True)
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)
    assert check(), what


async def held_by(engine: httpx.AsyncClient) -> set[str]:
    models = (await engine.get("/v1/models")).json()["data"]
    return {m["id"] for m in models if m.get("parent") == "base"}


def states(sync: AdapterSync) -> dict[str, AdapterState]:
    return {a.name: a.state for a in sync.report()}


# Each engine's own paths; both list what they hold in their model list, which is read back.
APIS = [d.adapter_api for d in (VllmDriver(), SglangDriver())]


@pytest.mark.parametrize("api", APIS, ids=["vllm", "sglang"])
def test_it_loads_unloads_fails_with_the_engine_s_words_and_loads_again_after_a_restart(
    api: AdapterApi,
) -> None:
    async def scenario() -> None:
        engine = sim()
        serving = False
        changes: list[int] = []
        sync = AdapterSync(
            api,
            lambda: EngineAt("http://sim", {}) if serving else None,
            engine,
            lambda: changes.append(1),
            "base-1/0",
            4,
            max_tries=3,
            backoff_base=0.01,
        )
        sync.want({"a": "org/a", "b": "org/b", "missing": "/no/such/adapter"})
        task = asyncio.ensure_future(sync.run())
        try:
            await asyncio.sleep(0.1)  # not serving yet: nothing is asked of it
            assert await held_by(engine) == set() and sync.loads == 0
            assert set(states(sync).values()) == {AdapterState.LOADING}

            serving = True
            sync.kick()
            await until("a, b loaded; missing failed", lambda: states(sync) == {
                "a": AdapterState.LOADED, "b": AdapterState.LOADED,
                "missing": AdapterState.FAILED})  # fmt: skip
            assert await held_by(engine) == {"a", "b"}
            [failed] = [r for r in sync.report() if r.name == "missing"]
            assert failed.tries == 3
            assert failed.error == (
                "Loading lora missing failed: No adapter found for /no/such/adapter"
            )

            # Another set: b unloaded, c loaded, a left as it is (one more load in all).
            sync.want({"a": "org/a", "c": "org/c"})
            await until("c loaded", lambda: states(sync).get("c") is AdapterState.LOADED)
            await until("b unloaded", lambda: "b" not in sync._extra)
            assert await held_by(engine) == {"a", "c"} and sync.loads == 3
            assert set(states(sync)) == {"a", "c"}

            # The engine lets one go by itself (it is full and something else was loaded into
            # it): the check of its list finds out, and it is loaded again.
            for name in ("d", "e", "f"):
                body = {"lora_name": name, "lora_path": f"org/{name}"}
                assert (await engine.post(api.load, json=body)).status_code == 200
            assert await held_by(engine) == {"c", "d", "e", "f"}  # a, least recently used, went
            sync.check()
            await until("a and c loaded again, d e f unloaded", lambda: sync.reloaded == 1
                        and not sync._extra and set(states(sync).values()) == {
                            AdapterState.LOADED})  # fmt: skip
            assert await held_by(engine) == {"a", "c"}

            # A new engine process holds nothing: everything is loaded into it again.
            engine_before, engine = engine, sim()
            sync._http = engine
            sync.restarted()
            assert set(states(sync).values()) == {AdapterState.LOADING}
            await until("a, c loaded again", lambda: set(states(sync).values()) == {
                AdapterState.LOADED})  # fmt: skip
            assert await held_by(engine) == {"a", "c"}
            await engine_before.aclose()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await engine.aclose()
        assert changes  # each state change was told

    asyncio.run(scenario())
