"""What every benchmark here shares: waiting for an event with a deadline that says what it
waited for, a fleet reached through its admin API, a state dir of its own, an orderly end on
SIGTERM, and the one JSON line each bench ends with.

Benches are run as scripts (`python bench/router.py`), so `bench/` is on their path and they
take this as `import kit`. CI imports every bench (tests/unit/test_benches.py): one that no
longer imports, because what it measures moved, fails there instead of rotting unseen.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml

from modelfleet.up import RunningFleet


def _given(result: Any) -> bool:
    return bool(result)


def wait(
    what: str,
    check: Callable[[], Any],
    timeout: float = 60.0,
    every: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
    done: Callable[[Any], bool] = _given,
) -> Any:
    """`check()`'s first answer that is `done` (by default: truthy), asked every `every`
    seconds; exceptions of the `ignore` kinds count as not yet. Raises RuntimeError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except ignore:
            result = None
        else:
            if done(result):
                return result
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


async def waited(
    what: str, done: Callable[[], bool], timeout: float, seen: Callable[[], str] = str
) -> float:
    """Seconds until `done()`, asked every 20 ms without blocking the event loop (a bench
    that serves agents from it); raises TimeoutError naming `what`, and what was `seen` by
    then, after `timeout`."""
    began = time.perf_counter()
    while not done():
        if time.perf_counter() - began > timeout:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}; {seen()}")
        await asyncio.sleep(0.02)
    return time.perf_counter() - began


def answers(url: str, verify: Any = True) -> bool:
    """Whether GET `url` answers 200 now (a connection refused: not yet)."""
    try:
        return httpx.get(url, timeout=2, verify=verify).status_code == 200
    except httpx.TransportError:
        return False


def answered(result: Any) -> bool:
    """A `done` for checks whose answer may be 0: anything but None and False."""
    return result is not None and result is not False


def json_line(figures: Mapping[str, Any]) -> None:
    """The line a bench ends with: its figures, as one JSON object."""
    print(json.dumps(figures), flush=True)


def state_dir(bench: str) -> Path:
    """A fresh folder for what a bench's services keep (never the working directory)."""
    return Path(tempfile.mkdtemp(prefix=f"modelfleet-bench-{bench}-"))


def end_on_sigterm() -> None:
    """SIGTERM ends the bench as Ctrl-C does, through its `finally` blocks, so that the
    processes it started are stopped (Python's default would leave them running)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


class AdminFleet:
    """A fleet `up` started, as an operator reaches it through its admin API."""

    def __init__(self, running: RunningFleet, timeout: float = 10.0) -> None:
        self.running = running
        self.timeout = timeout
        self.admin = self.connect()

    def connect(self) -> httpx.Client:
        """A client of the admin API where it is now (a restarted control plane moves)."""
        return httpx.Client(
            base_url=self.running.admin_url,
            headers={"authorization": f"Bearer {self.running.admin_token}"},
            timeout=self.timeout,
        )

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        """The replicas (of `model`), as `ctl replicas` lists them."""
        listed: list[dict[str, Any]] = self.admin.get("/v1/replicas").json()["replicas"]
        return [r for r in listed if model is None or r["model"] == model]

    def events(self, reason: str) -> list[dict[str, Any]]:
        """The last 1,000 events with this reason."""
        found = self.admin.get("/v1/events", params={"limit": 1000}).json()["events"]
        return [e for e in found if e["reason"] == reason]

    def mark(self, node: str, mark: str, **extra: Any) -> None:
        self.admin.post(f"/v1/nodes/{node}/mark", json={"mark": mark, **extra}).raise_for_status()

    def apply(self, *models: dict[str, Any]) -> None:
        """Make `models` the catalog."""
        body = yaml.safe_dump({"models": list(models)})
        self.admin.put("/v1/catalog", content=body).raise_for_status()
