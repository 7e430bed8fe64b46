"""Pieces of the OpenAI HTTP API that both the router and the engine simulator speak."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from modelfleet.core.catalog import name_problem
from modelfleet.core.nesting import TooDeep, check_json
from modelfleet.http.web import JSON


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> bytes:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
) -> Response:
    """An OpenAI-style error answer; `retry_after` (seconds) for one worth trying again."""
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    return Response(
        error_body(message, type_, code, param),
        status_code=status,
        media_type=JSON,
        headers=headers,
    )


class BadRequest(ValueError):
    """A request body the API cannot accept; the message names what is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_body(raw: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object naming a model, nested no deeper than
    `nesting.MAX_DEPTH` (deeper, json.loads raised RecursionError: a 500)."""
    try:
        check_json(raw)
    except TooDeep as exc:
        raise BadRequest(f"the request body is {exc}") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if (problem := name_problem(model)) is not None:
        raise BadRequest(f"'model': {problem}", param="model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    return body


# The fields of a generation request that the router itself reads: for token limits (what a
# request may use) and for streams (whether to ask the engine for usage).
_COUNTS = ("max_tokens", "max_completion_tokens", "n")


def check_generation(body: dict[str, Any]) -> None:
    """Refuse a completion or chat request whose fields the router reads are malformed:
    `max_tokens`, `max_completion_tokens` and `n` must be whole numbers of at least 1 (a
    negative `max_tokens` once reserved a negative estimate against a key's token limit),
    `stream_options` an object, the text of a chat's content parts a string."""
    for name in _COUNTS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            shown = repr(value)[:40]
            raise BadRequest(f"'{name}' must be a whole number, not {shown}", param=name)
        if value < 1:
            raise BadRequest(f"'{name}' must be at least 1, not {value}", param=name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    check_content_parts(body)


def check_content_parts(body: dict[str, Any]) -> None:
    """Refuse a chat whose messages' content parts carry a `text` that is not a string
    (`prompt_text` joins them: a number there was a 500). What else a message holds is the
    engine's to judge."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and not isinstance(part.get("text", ""), str):
                param = f"messages[{i}].content[{j}].text"
                raise BadRequest(f"'{param}' must be a string", param=param)


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """The text of a chat's messages or a completion's prompt, for counting tokens."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                raise BadRequest("each message must be an object", param="messages")
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p.get("text", "") for p in content if isinstance(p, dict)]
        return " ".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)
    raise BadRequest("'prompt' must be a string or a list of strings", param="prompt")
