"""What the simulator accepts of an OpenAI request: what vLLM accepts and the simulator can
honour, with vLLM's limits; the rest is refused with a 400 naming the field, never answered
as if it had been honoured (a `tool_choice: required` answered with plain text, say)."""

from __future__ import annotations

from typing import Any

from modelfleet.http.openai_api import BadRequest

# name: (lowest, highest) for the sampling parameters it takes and ignores, as vLLM bounds them.
_NUMBERS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 10.0),
    "min_p": (0.0, 1.0),
}


def check_request(body: dict[str, Any], chat: bool) -> None:
    """Raise BadRequest for a field the simulator cannot take as vLLM would."""
    for name, (low, high) in _NUMBERS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"'{name}' must be a number, not {repr(value)[:40]}", param=name)
        if not low <= value <= high:
            raise BadRequest(f"'{name}' must be between {low:g} and {high:g}", param=name)
    for name in ("seed", "top_k"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"'{name}' must be a whole number", param=name)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if body.get("n", 1) != 1:
        # Refused rather than answered with one choice: a client asking for several would
        # take the one it got for all it asked for.
        raise BadRequest("this engine makes one choice per request: 'n' must be 1", param="n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise BadRequest("this engine simulates no log probabilities", param="logprobs")
    if chat:
        _check_tools(body)
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise BadRequest(
                "'response_format.type' must be text, json_object or json_schema",
                param="response_format",
            )
        if kind != "text":
            raise BadRequest(
                f"this engine writes plain text only, not {kind}", param="response_format"
            )


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise BadRequest("'tools' must be a list of objects", param="tools")
    if choice is None or choice in ("none", "auto"):
        return  # with "auto" a model may answer in text, and this one always does
    if choice != "required" and not isinstance(choice, dict):
        raise BadRequest(
            "'tool_choice' must be none, auto, required or a named function",
            param="tool_choice",
        )
    if not tools:
        raise BadRequest("'tool_choice' names a tool but 'tools' is empty", param="tool_choice")
    raise BadRequest(
        "this engine never calls tools: it cannot honour tool_choice required or a named function",
        param="tool_choice",
    )
