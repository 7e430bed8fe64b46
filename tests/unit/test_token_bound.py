"""The most tokens a request can cost (`core/token_bound.py`): never less than what an engine
counts, whatever shape the prompt takes and whichever output fields it sets.

What an engine counts is modelled by its worst plausible tokenizer and template: one token a
UTF-8 byte with BOS and EOS (no real tokenizer makes more of a text; Llama 2's SentencePiece
with byte fallback makes at most that), the simulator's one token a word, and for chats a
Llama-3-style template with a default system prompt; its output as vLLM bounds it."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from modelfleet.core.token_bound import (
    CHAT_BASE,
    MEDIA_TOKENS,
    bounded_output,
    output_bound,
    token_bound,
)
from modelfleet.simulator.engine import count_prompt_tokens

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
DEFAULT = 300


def byte_tokens(text: str) -> int:
    """The worst tokenizer: every UTF-8 byte a token, and BOS and EOS."""
    return len(text.encode("utf-8", "surrogatepass")) + 2


def text_counts(text: str) -> int:
    return max(byte_tokens(text), count_prompt_tokens(text))


def prompt_counts(prompt: Any) -> tuple[int, int]:
    """An engine's prompt tokens for a completion's prompt, and how many prompts."""
    if prompt is None:
        return 0, 1
    if isinstance(prompt, str):
        return text_counts(prompt), 1
    if all(isinstance(t, int) for t in prompt):
        return len(prompt), 1
    if all(isinstance(p, str) for p in prompt):
        return sum(text_counts(p) for p in prompt), max(1, len(prompt))
    return sum(len(p) for p in prompt), max(1, len(prompt))


def chat_counts(body: dict[str, Any]) -> int:
    """A Llama-3-style template over the worst tokenizer: BOS, a default system prompt of 40
    tokens, the instructions that come with tools (90) and the tools' JSON, each message
    framed by 5 marks, its role, its text, 10 marks and the name and arguments of each tool
    call, every image counted as the most an encoder makes of one, and the reply's header."""
    tokens = 1 + 40 + 4
    if body.get("tools"):
        tokens += 90 + len(json.dumps(body["tools"], ensure_ascii=False).encode())
    for message in body["messages"]:
        tokens += 5 + byte_tokens(message["role"])
        content = message.get("content")
        if isinstance(content, str):
            tokens += max(byte_tokens(content), count_prompt_tokens(content))
        elif isinstance(content, list):
            for part in content:
                if part["type"] == "text":
                    tokens += byte_tokens(part["text"])
                else:
                    tokens += MEDIA_TOKENS
        for call in message.get("tool_calls") or []:
            function = call["function"]
            tokens += 10 + byte_tokens(function["name"]) + byte_tokens(function["arguments"])
        if "name" in message:
            tokens += byte_tokens(message["name"])
    return tokens


def engine_output(body: dict[str, Any], path: str) -> int:
    """What vLLM lets one choice produce: a chat `max_completion_tokens or max_tokens`, a
    completion `max_tokens` (16 when absent); unbounded (None) here means the whole context,
    which no sent request is left with (`bounded_output`)."""
    if path == CHAT:
        bound = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        bound = body.get("max_tokens", 16)
    assert bound is not None, "a request went out with no bound on its output"
    return int(bound)


def engine_usage(body: dict[str, Any], path: str) -> int:
    """The most usage an engine reports for `body` (as sent)."""
    if path == EMBEDDINGS:
        return prompt_counts(body["input"])[0]
    choices = max(body.get("n") or 1, body.get("best_of") or 1)
    if path == CHAT:
        return chat_counts(body) + choices * engine_output(body, path)
    tokens, prompts = prompt_counts(body.get("prompt"))
    if "suffix" in body:
        tokens += byte_tokens(body["suffix"])
    return tokens + prompts * choices * engine_output(body, path)


texts = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=" \t\n", max_size=60),  # whitespace: the simulator counts a token a word
    st.text(alphabet="a ", max_size=60),
    st.text(alphabet="😀中文한국어", max_size=30),  # four and three bytes a character
)
ids = st.lists(st.integers(0, 200_000), max_size=40)
bounds = st.one_of(st.none(), st.integers(1, 2_000))


def _output_fields(draw: st.DrawFn, body: dict[str, Any]) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        if draw(st.booleans()):
            body[name] = draw(bounds)  # absent, null or a number
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        body["best_of"] = draw(st.integers(1, 5))


@st.composite
def chats(draw: st.DrawFn) -> dict[str, Any]:
    text_part = st.builds(lambda t: {"type": "text", "text": t}, texts)
    image_part = st.builds(
        lambda u: {"type": "image_url", "image_url": {"url": u}}, st.text(max_size=20)
    )
    content = st.one_of(texts, st.none(), st.lists(st.one_of(text_part, image_part), max_size=4))
    call = st.builds(
        lambda n, a: {"id": "c", "type": "function", "function": {"name": n, "arguments": a}},
        texts,
        texts,
    )

    @st.composite
    def message(draw2: st.DrawFn) -> dict[str, Any]:
        m: dict[str, Any] = {
            "role": draw2(st.sampled_from(["system", "user", "assistant", "tool"])),
            "content": draw2(content),
        }
        if draw2(st.booleans()):
            m["name"] = draw2(texts)
        if m["role"] == "assistant" and draw2(st.booleans()):
            m["tool_calls"] = draw2(st.lists(call, max_size=2))
        return m

    body: dict[str, Any] = {"model": "m", "messages": draw(st.lists(message(), min_size=1))}
    if draw(st.booleans()):
        body["tools"] = [
            {"type": "function", "function": {"name": draw(texts), "parameters": {}}}
            for _ in range(draw(st.integers(1, 3)))
        ]
    _output_fields(draw, body)
    return body


@st.composite
def completions(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(st.one_of(texts, st.lists(texts, max_size=6), ids, st.lists(ids, max_size=6)))
    body: dict[str, Any] = {"model": "m", "prompt": prompt}
    if draw(st.booleans()):
        body["suffix"] = draw(texts)
    _output_fields(draw, body)
    return body


def _sent(body: dict[str, Any], path: str) -> tuple[int, dict[str, Any]]:
    """What the router reserves for `body`, and the body it sends on: with its output bound
    written in, which changes nothing of what is reserved."""
    reserved = token_bound(body, path, DEFAULT)
    raw = json.dumps(body).encode()
    sent = json.loads(bounded_output(body, raw, DEFAULT))
    assert sent == body  # the body the router goes on with is the one it sends
    assert token_bound(sent, path, DEFAULT) == reserved
    return reserved, sent


@settings(max_examples=300, deadline=None)
@given(chats())
def test_a_chat_never_costs_more_than_its_reservation(body: dict[str, Any]) -> None:
    reserved, sent = _sent(body, CHAT)
    assert reserved >= engine_usage(sent, CHAT)


@settings(max_examples=300, deadline=None)
@given(completions())
@example({"model": "m", "prompt": [[7] * 450], "max_tokens": 1})  # ids once estimated at 0
@example({"model": "m", "prompt": ["a b"] * 8, "max_tokens": 50})  # a list of prompts
@example({"model": "m", "prompt": "😀" * 30, "max_tokens": 1})  # 15x under, at 4 chars a token
@example({"model": "m", "prompt": "a " * 60, "max_tokens": 1})  # 2x under on the simulator
@example({"model": "m", "prompt": "x", "max_completion_tokens": None, "max_tokens": 5})
def test_a_completion_never_costs_more_than_its_reservation(body: dict[str, Any]) -> None:
    reserved, sent = _sent(body, COMPLETIONS)
    assert reserved >= engine_usage(sent, COMPLETIONS)


@settings(max_examples=200, deadline=None)
@given(st.one_of(texts, st.lists(texts, max_size=6), ids, st.lists(ids, max_size=6)))
def test_an_embedding_never_costs_more_than_its_reservation(given_input: Any) -> None:
    body = {"model": "m", "input": given_input}
    assert token_bound(body, EMBEDDINGS, DEFAULT) >= engine_usage(body, EMBEDDINGS)


def test_token_ids_count_one_each_and_a_list_of_prompts_their_sum() -> None:
    assert token_bound({"prompt": [5] * 450, "max_tokens": 1}, COMPLETIONS, DEFAULT) == 451
    # Each prompt of a list gets its own choices: 3 prompts x n=2 x 10 tokens.
    body = {"prompt": [[1, 2], [3], [4, 5, 6]], "max_tokens": 10, "n": 2}
    assert token_bound(body, COMPLETIONS, DEFAULT) == 6 + 3 * 2 * 10
    assert token_bound({"input": [[1, 2], [3]]}, EMBEDDINGS, DEFAULT) == 3


def test_an_image_counts_as_the_most_an_encoder_makes_of_one_not_its_bytes() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 99_999}}
    body = {"messages": [{"role": "user", "content": [image]}], "max_tokens": 1}
    reserved = token_bound(body, CHAT, DEFAULT)
    assert MEDIA_TOKENS + CHAT_BASE < reserved < MEDIA_TOKENS + CHAT_BASE + 100


def test_the_output_bound_is_the_larger_field_and_a_request_naming_none_is_given_one() -> None:
    assert output_bound({"max_tokens": 5, "max_completion_tokens": 900}, DEFAULT) == 900
    assert output_bound({"max_completion_tokens": None}, DEFAULT) == DEFAULT
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    raw = bounded_output(body, json.dumps(body).encode(), DEFAULT)
    assert json.loads(raw) == {"model": "m", "prompt": "hi", "max_tokens": DEFAULT}
    # null in max_tokens falls to max_completion_tokens, as vLLM's chat reads them.
    body = {"model": "m", "prompt": "hi", "max_tokens": None, "max_completion_tokens": 7}
    assert json.loads(bounded_output(body, json.dumps(body).encode(), DEFAULT))["max_tokens"] == 7
    named = {"model": "m", "max_tokens": 3}
    assert bounded_output(named, b"unchanged", DEFAULT) == b"unchanged"
