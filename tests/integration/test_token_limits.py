"""A tenant with a small token limit tries every field of the OpenAI API to be served more
than it, through a real router in front of a real engine simulator: what the engine counts
it served stays within the limit and one request's worth, with the router's memory and with
Redis shared by two workers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelfleet.core.token_bound import token_bound

from ..redis_kit import redis_server
from .conftest import Procs
from .test_processes import start_engine, start_router
from .test_router_data_path import counter

TPM = 1_000
DEFAULT_MAX = 40  # the router's default_max_tokens
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _attempts() -> list[tuple[str, dict[str, Any]]]:
    """Requests that each once cost a key more than it reserved."""
    said = [{"role": "user", "content": "x " * 100}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "y " * 100}]}]
    return [
        (COMPLETIONS, {"prompt": [[7] * 300] * 3, "max_tokens": 50}),  # ids: 0 estimated
        (COMPLETIONS, {"prompt": ["a b c d"] * 20, "max_tokens": 20}),  # a list of prompts
        (COMPLETIONS, {"prompt": "a " * 200, "max_tokens": 10}),  # 2x under on the simulator
        (COMPLETIONS, {"prompt": "😀" * 50, "max_tokens": 10}),  # 15x under at 4 chars a token
        (COMPLETIONS, {"prompt": "go", "max_completion_tokens": 30}),  # ignored by completions
        (COMPLETIONS, {"prompt": "go", "max_tokens": None}),  # the whole context, on vLLM
        (COMPLETIONS, {"prompt": "go"}),
        (CHAT, {"messages": said, "max_completion_tokens": None}),
        (CHAT, {"messages": said, "max_completion_tokens": None, "max_tokens": 30}),
        (CHAT, {"messages": parts, "stream": True}),  # its usage hidden from the client
        (CHAT, {"messages": said, "n": 2, "max_tokens": 5}),
    ]


async def _burst(router: str, key: str, copies: int) -> list[httpx.Response]:
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=router, headers=headers, timeout=60) as client:

        async def one(path: str, body: dict[str, Any]) -> httpx.Response:
            answer = await client.post(path, json={"model": "m", **body})
            await answer.aread()
            return answer

        sends = [one(p, b) for p, b in _attempts() for _ in range(copies)]
        return list(await asyncio.gather(*sends))


def _served(engine: str) -> float:
    """The tokens the engine counts it served: prompts and output."""
    page = httpx.get(f"{engine}/metrics", timeout=10).text
    return counter(page, "vllm:prompt_tokens_total") + counter(page, "vllm:generation_tokens_total")


@pytest.mark.parametrize("store", ["memory", "redis-2-workers"])
def test_a_tenant_trying_every_field_is_served_no_more_than_its_token_limit(
    procs: Procs, tmp_path: Path, store: str
) -> None:
    # An engine that, unbounded, writes 3,000 tokens: a bound the router did not reserve shows.
    engine, _ = start_engine(
        procs, tmp_path, "m", "--itl", "0", "--ttft", "0", "--output-tokens", "3000",
        "--max-model-len", "8192",
    )  # fmt: skip
    key = "tenant-key"
    options: dict[str, Any] = {
        "api_keys": [{"name": "tenant", "key": key, "tpm": TPM}],
        "default_max_tokens": DEFAULT_MAX,
    }

    def attack() -> None:
        router = start_router(procs, tmp_path, [{"name": "m", "endpoints": [engine]}], **options)
        began = time.monotonic()
        answers = asyncio.run(_burst(router, key, copies=3))
        took = time.monotonic() - began
        served = _served(engine)
        worth = max(token_bound(b, p, DEFAULT_MAX) for p, b in _attempts())
        codes = sorted(a.status_code for a in answers)
        print(
            f"{store}: {len(answers)} requests in {took:.1f} s, {served:g} tokens served, {codes}"
        )
        assert took < 60, "the burst must fit in one minute for the limit to bound it"
        assert 200 in codes and 429 in codes  # some served, the rest refused for tokens
        refused = [a.json()["error"] for a in answers if a.status_code == 429]
        assert all(e["type"] == "tokens" for e in refused), json.dumps(refused)[:300]
        assert served <= TPM + worth

    if store == "memory":
        attack()
        return
    with redis_server(tmp_path) as url:
        options.update(limits_store=url, workers=2)
        attack()
