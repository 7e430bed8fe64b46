"""The tokens an answer used, read from the engine's `usage` as the answer passes through,
and the router's ledger of what each key used, collected by the control plane.

A whole answer carries `usage` in its JSON; it is kept as it is relayed and searched once,
after it went to the client. A stream carries it only when asked
(`stream_options.include_usage`), in a last event whose `choices` is empty: the router asks
for it on every stream, and when the client did not, that event is taken out of what the
client gets, so the client sees the stream it asked for. Events are only looked into when
they hold `prompt_tokens`; an event cut across two chunks is held back until it is whole.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from modelfleet.messages.wire import UsageBatch, UsageRow

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
        self._usage: Usage | None = None
        self._held = b""  # a stream's incomplete last event
        self._whole: list[bytes] = []  # a whole answer, as relayed

    @property
    def usage(self) -> Usage | None:
        """The answer's usage, once it has passed. A whole answer is searched only when this
        is first read, after the answer went to the client: its latency does not pay for it."""
        if self._whole:
            self._usage = read_usage(b"".join(self._whole))
            self._whole = []
        return self._usage

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
                    self._usage = found
                    if self.hide and _NO_CHOICES.search(event):
                        continue
            kept.append(event)
        return b"\n\n".join(kept)

    def finish(self) -> bytes:
        """The answer has ended: what is still held goes to the client."""
        if not self.stream:
            return b""
        held, self._held = self._held, b""
        return held


@dataclass
class _Counts:
    requests: int = 0
    prompt: int = 0
    completion: int = 0
    errors: int = 0
    limited: int = 0
    last_at: float = 0.0


@dataclass
class UsageLedger:
    """Counts per key, model and hour, handed to the control plane in batches.

    A batch taken is kept until the control plane acknowledges it, and sent again until then,
    so a lost answer loses nothing; the control plane stores each (run, batch) once. What a
    router loses when it dies is what it counted since its last acknowledged batch.
    """

    run: str = field(default_factory=lambda: secrets.token_hex(8))
    _pending: dict[tuple[str, str, int], _Counts] = field(default_factory=dict)
    _batch: UsageBatch | None = None
    _next: int = 1

    def count(self, key: str, model: str, now: float, usage: Usage | None, status: int) -> None:
        hour = int(now // 3600) * 3600
        counts = self._pending.get((key, model, hour))
        if counts is None:
            counts = self._pending[(key, model, hour)] = _Counts()
        counts.requests += 1
        if usage is not None:
            counts.prompt += usage.prompt
            counts.completion += usage.completion
        counts.errors += status >= 400
        counts.limited += status == 429
        counts.last_at = now

    def take(self) -> UsageBatch | None:
        """The batch to send: the unacknowledged one, else what was counted since."""
        if self._batch is None and self._pending:
            rows = [
                UsageRow(
                    key=key,
                    model=model,
                    hour=hour,
                    requests=c.requests,
                    prompt_tokens=c.prompt,
                    completion_tokens=c.completion,
                    errors=c.errors,
                    last_at=c.last_at,
                    limited=c.limited,
                )
                for (key, model, hour), c in self._pending.items()
            ]
            self._batch = UsageBatch(run=self.run, batch=self._next, rows=rows)
            self._next += 1
            self._pending = {}
        return self._batch

    def ack(self, run: str, batch: int) -> bool:
        """The control plane stored (run, batch): forget it. Whether it was ours."""
        if self._batch is not None and (run, batch) == (self.run, self._batch.batch):
            self._batch = None
            return True
        return False
