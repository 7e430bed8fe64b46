"""The most tokens an OpenAI request can cost, read from its body before any engine has seen
it: what a key's token limit reserves at admission. Pure.

A reservation must never be less than what the engine then reports, or a burst of requests
admitted together overshoots the limit before their usage is known (150 prompts of token ids,
estimated at 0 prompt tokens each, were all admitted on a `tpm 1000` key: 67,650 tokens). So
every figure here is a bound, not a guess:

- **Prompt.** Token ids count one each (`[1, 2, 3]`: 3), a list of prompts the sum of its
  prompts. Text counts its UTF-8 bytes: a tokenizer makes at most one token of each byte (a
  byte-level BPE never more; SentencePiece's byte fallback neither), plus `PER_TEXT` for the
  marks a tokenizer adds around a text (BOS, a leading piece). The four characters a token
  this replaced under-counted emoji and CJK fifteen times, whitespace twice.
- **Chat.** A chat template wraps each message in marks of its own and may add a system
  prompt of its own: each message counts the UTF-8 bytes of its JSON (role, name, tool calls
  and the text of its content parts; the JSON's quotes and keys stand for the template's
  marks), plus `CHAT_BASE` once. A content part that is no text (an image, audio, video, a
  file) counts `MEDIA_TOKENS`: its bytes say nothing of the tokens an encoder makes of it.
  Every other field of the body that is not known to stay out of the prompt (tools,
  documents, template arguments, any field this module does not know) counts its JSON bytes.
- **Output.** Each choice may produce the larger of `max_tokens` and
  `max_completion_tokens` (engines honour one or the other, by path and by kind); a request
  that bounds neither is sent with `max_tokens` set (`bounded_output`), so that its bound is
  known. Every prompt of a list gets its own choices, and `n` (or `best_of`, when larger)
  choices each.

A model's tokenizer would count closer; neither the router nor its agent loads one, so these
bounds can only over-count, by the bytes a token holds beyond one.
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

PER_TEXT = 2  # tokens a tokenizer adds around one text: BOS/EOS, a leading piece
# Tokens a chat template adds once: BOS, the reply's header, a default system prompt (Llama
# 3.1's dates, Qwen's "You are Qwen..."), the instructions that come with tools.
CHAT_BASE = 128
MEDIA_TOKENS = 16_384  # a content part that is no text: Qwen2-VL's most for one image
TEXT_PARTS = frozenset({"text", "input_text", "refusal"})

# Top-level fields of a request that never reach the prompt; every other one counts.
NOT_PROMPT = frozenset(
    {
        "model", "messages", "prompt", "input", "stream", "stream_options",
        "max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "temperature",
        "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "logit_bias",
        "user", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
        "spaces_between_special_tokens", "response_format", "encoding_format", "dimensions",
        "parallel_tool_calls", "tool_choice", "priority", "request_id", "add_generation_prompt",
        "continue_final_message", "add_special_tokens", "truncate_prompt_tokens",
    }
)  # fmt: skip

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"


def token_bound(body: dict[str, Any], path: str, default_max: int) -> int:
    """The most tokens the request `body` to `path` can cost: its prompt and every choice's
    output at most; `default_max` for the output of a request that bounds none."""
    if path == EMBEDDINGS:
        if "input" not in body and "messages" in body:  # vLLM embeds a chat, too
            return chat_prompt(body)
        return prompt_tokens(body.get("input"))[0] + _other_fields(body)
    per_choice = output_bound(body, default_max)
    choices = _choices(body)
    if path == CHAT:
        return chat_prompt(body) + choices * per_choice
    tokens, prompts = prompt_tokens(body.get("prompt"))
    return tokens + _other_fields(body) + prompts * choices * per_choice


def prompt_tokens(prompt: Any) -> tuple[int, int]:
    """The most tokens of a completion's prompt (or an embedding's input), and how many
    prompts it is: a text, token ids, a list of texts or of token id lists. What is none of
    these counts the bytes of its JSON (an engine refuses it, but this still bounds it)."""
    if prompt is None:
        return 0, 1
    if isinstance(prompt, str):
        return text_tokens(prompt), 1
    if isinstance(prompt, list):
        if all(_is_id(t) for t in prompt):
            return len(prompt), 1
        if all(isinstance(p, str) for p in prompt):
            return sum(text_tokens(p) for p in prompt), max(1, len(prompt))
        if all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt):
            return sum(len(p) for p in prompt), max(1, len(prompt))
        return _json_bytes(prompt), max(1, len(prompt))
    return _json_bytes(prompt), 1


def chat_prompt(body: dict[str, Any]) -> int:
    """The most tokens of a chat's prompt as a chat template renders it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return CHAT_BASE + _json_bytes(messages) + _other_fields(body)
    return CHAT_BASE + sum(_message_tokens(m) for m in messages) + _other_fields(body)


def output_bound(body: dict[str, Any], default_max: int) -> int:
    """The most tokens one choice may produce: the larger of `max_tokens` and
    `max_completion_tokens`, `default_max` when neither is a number."""
    bounds = _numbers(body, ("max_tokens", "max_completion_tokens"))
    return max(bounds) if bounds else default_max


def bounded_output(body: dict[str, Any], raw: bytes, default_max: int) -> bytes:
    """`raw`, the JSON of `body`, with `max_tokens` set where it is absent or null: to
    `max_completion_tokens` when that is a number, else `default_max`. An engine bounds a
    request's output by one of the two fields or by its own default (vLLM: 16 for a
    completion, the whole context for a chat, `null` too), so only a request that names a
    number in `max_tokens` is bound by what `output_bound` reserved, whatever the engine.
    `body` is changed to match."""
    if _is_id(body.get("max_tokens")):
        return raw
    bound = output_bound(body, default_max)
    absent = "max_tokens" not in body
    body["max_tokens"] = bound
    if absent:  # spliced before the closing brace: no second encoding of a long prompt
        inner = raw.rstrip()[:-1].rstrip()
        return inner + b',"max_tokens":' + str(bound).encode() + b"}"
    return json.dumps(body).encode()


def text_tokens(text: str) -> int:
    """The most tokens a tokenizer makes of `text`: one a UTF-8 byte, and its marks."""
    return len(text.encode("utf-8", "surrogatepass")) + PER_TEXT


def _message_tokens(message: Any) -> int:
    if not isinstance(message, dict):
        return _json_bytes(message)
    content = message.get("content")
    if not isinstance(content, list):
        return _json_bytes(message)
    media = [
        p
        for p in content
        if isinstance(p, dict) and isinstance(p.get("type"), str) and p["type"] not in TEXT_PARTS
    ]
    if not media:
        return _json_bytes(message)
    rest = [p for p in content if not any(p is m for m in media)]
    return _json_bytes({**message, "content": rest}) + MEDIA_TOKENS * len(media)


def _other_fields(body: dict[str, Any]) -> int:
    """The JSON bytes of the fields of `body` that may reach the prompt, beyond the prompt
    itself (tools, documents, a chat template's arguments, any field not known)."""
    return sum(_json_bytes({k: v}) for k, v in body.items() if k not in NOT_PROMPT)


def _choices(body: dict[str, Any]) -> int:
    """Choices made for each prompt: `n`, or `best_of` when larger (vLLM makes that many
    and returns the best `n`)."""
    return max([1, *_numbers(body, ("n", "best_of"))])


def _numbers(body: dict[str, Any], names: tuple[str, ...]) -> list[int]:
    """The whole numbers among `body`'s fields `names`."""
    found = []
    for name in names:
        value = body.get(name)
        if _is_id(value):
            found.append(value)
    return found


def _is_id(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_bytes(value: Any) -> int:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not from JSON; no such body reaches here
        text = repr(value)
    return len(text.encode("utf-8", "surrogatepass"))
