"""A steady client: threads sending chat completions to one model through a router, without
pause, every other one streaming. Each answer is checked whole (status, token count, a stream's
closing `[DONE]`), so a request cut short counts as a failure, not as a success.

Tests and benchmarks use it to count failures while the fleet changes under it; an operator can
use it the same way against `modelfleet up` to rehearse a change.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Outcome:
    """One request: when it ended (time.monotonic()) and what went wrong ("" when nothing)."""

    ended: float
    error: str


@dataclass
class SteadyClient:
    router: str
    key: str
    model: str
    workers: int = 4
    max_tokens: int = 3
    pace: float | None = None  # requests per second over all workers; None: as fast as they go
    # More of each request's body: `{"ignore_eos": True}` keeps a real engine from ending an
    # answer early, which would count as cut short.
    extra: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    started: float = 0.0
    stopped: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.started = time.monotonic()
        for i in range(self.workers):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self.stopped = time.monotonic()

    @property
    def ok(self) -> int:
        return sum(1 for o in self.outcomes if not o.error)

    @property
    def failures(self) -> list[str]:
        return [f"{o.ended - self.started:.2f}s: {o.error}" for o in self.outcomes if o.error]

    @property
    def rate(self) -> float:
        """Successful requests per second over the whole run."""
        return self.ok / max(1e-9, (self.stopped or time.monotonic()) - self.started)

    def window(self, since: float, until: float) -> tuple[float, int]:
        """(successful requests per second, failed requests) among those ending in the window."""
        inside = [o for o in self.outcomes if since <= o.ended < until]
        ok = sum(1 for o in inside if not o.error)
        return ok / max(1e-9, until - since), len(inside) - ok

    def _run(self, worker: int) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.router, headers=headers, timeout=30) as http:
            n = 0
            every = self.workers / self.pace if self.pace else 0.0
            due = time.monotonic()
            while not self._stop.is_set():
                n += 1
                error = self._one(http, stream=(n + worker) % 2 == 0)
                with self._lock:
                    self.outcomes.append(Outcome(time.monotonic(), error))
                # Paced, with no catch-up burst after a slow request.
                due = max(due + every, time.monotonic())
                self._stop.wait(max(0.0, due - time.monotonic()))

    def _one(self, http: httpx.Client, stream: bool) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "steady"}],
            "max_tokens": self.max_tokens,
            "stream": stream,
            **self.extra,
        }
        try:
            if stream:
                body["stream_options"] = {"include_usage": True}  # its last chunk counts tokens
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    text = "".join(r.iter_text())
                if r.status_code != 200:
                    return f"stream HTTP {r.status_code}: {text[:200]}"
                complete = text.rstrip().endswith("data: [DONE]")
                if not complete or _streamed_tokens(text) != self.max_tokens:
                    return f"stream cut short: {text[-200:]!r}"
                return ""
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:200]}"
            if r.json()["usage"]["completion_tokens"] != self.max_tokens:
                return f"wrong usage: {r.text[:200]}"
            return ""
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"


def _streamed_tokens(text: str) -> int | None:
    """The completion tokens a stream's usage chunk counts; None without one."""
    for line in reversed(text.splitlines()):
        if line.startswith("data: {"):
            usage = json.loads(line[len("data: ") :]).get("usage")
            if usage:
                return int(usage["completion_tokens"])
    return None
