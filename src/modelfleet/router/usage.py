"""The tokens an answer used, read from the engine's `usage` as the answer passes through.

A whole answer carries `usage` in its JSON; it is kept as it is relayed and searched once at
the end. A stream carries it only when asked (`stream_options.include_usage`), in a last
event whose `choices` is empty: the router asks for it on every stream, and when the client
did not, that event is taken out of what the client gets, so the client sees the stream it
asked for. Events are only looked into when they hold `prompt_tokens`; an event cut across
two chunks is held back until it is whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


@dataclass(frozen=True)
class Usage:
    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def read_usage(data: bytes) -> Usage | None:
    """The last `usage` in `data`, or None when it has none."""
    prompts = _PROMPT.findall(data)
    if not prompts:
        return None
    completions = _COMPLETION.findall(data)
    return Usage(int(prompts[-1]), int(completions[-1]) if completions else 0)


class UsageScanner:
    """Finds the usage of one answer while it is relayed."""

    def __init__(self, stream: bool, hide_usage_event: bool) -> None:
        self.stream = stream
        self.hide = hide_usage_event
        self.usage: Usage | None = None
        self._held = b""  # a stream's incomplete last event
        self._whole: list[bytes] = []  # a whole answer, as relayed

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` goes to the client now."""
        if not self.stream:
            self._whole.append(chunk)
            return chunk
        data = self._held + chunk if self._held else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._held = data
            return b""
        end += 2
        self._held = data[end:]
        ready = data[:end]
        if b"prompt_tokens" not in ready:
            return ready
        kept = []
        for event in ready.split(b"\n\n"):
            if b"prompt_tokens" in event:
                found = read_usage(event)
                if found is not None:
                    self.usage = found
                    if self.hide and _NO_CHOICES.search(event):
                        continue
            kept.append(event)
        return b"\n\n".join(kept)

    def finish(self) -> bytes:
        """The answer has ended: what is still held goes to the client."""
        if not self.stream:
            self.usage = read_usage(b"".join(self._whole))
            self._whole = []
            return b""
        held, self._held = self._held, b""
        return held
