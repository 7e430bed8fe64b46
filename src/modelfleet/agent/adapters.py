"""The LoRA adapters one engine should hold, loaded and unloaded through the engine's API.

The control plane says which adapters a replica holds (`ShardAssignment.adapters`); the agent
makes its engine hold exactly those while it serves: adapters no longer wanted are unloaded
first (their slots are what the new ones need), then every wanted one not held is loaded, all
at once, never more than `max_loras` held or on their way: an engine that is full lets go of
one it holds by itself (vLLM's and SGLang's LRU), so a load under way that is no longer wanted
is let finish and unloaded after, not abandoned. A load the engine refuses is asked again
after a backoff, and after `max_tries` it is reported failed with the engine's own words and
left alone until the control plane wants it from another source. An engine started anew holds
nothing: every adapter is loaded again as soon as it is ready, and reported loaded only once
it is, so no request for it goes there before.

What the engine holds is checked against what the agent thinks it holds (its model list, where
the engine has one) once loads are over and every `VERIFY_S`: one it holds unasked is
unloaded, and one it let go of by itself is loaded again, instead of its requests being
answered 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from modelfleet.engines.base import AdapterApi
from modelfleet.messages.wire import AdapterReport, AdapterState

log = logging.getLogger("modelfleet.agent")

MAX_TRIES = 5
VERIFY_S = 5.0
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
_ERROR_CHARS = 500


@dataclass(frozen=True)
class EngineAt:
    """Where an engine that serves now answers: its base URL and the headers it wants."""

    url: str
    headers: dict[str, str]


@dataclass
class _Held:
    source: str
    state: AdapterState = AdapterState.LOADING
    tries: int = 0
    error: str = ""
    retry_at: float = 0.0  # monotonic: not asked again before
    task: asyncio.Task[None] | None = None
    loaded_at: float = 0.0  # monotonic: when the engine said it had it


class AdapterSync:
    """Keeps one engine's adapters as its assignment says; `run` does the work."""

    def __init__(
        self,
        api: AdapterApi,
        engine: Callable[[], EngineAt | None],
        http: httpx.AsyncClient,
        changed: Callable[[], None],
        name: str,
        max_loras: int,
        max_tries: int = MAX_TRIES,
        backoff_base: float = BACKOFF_BASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self._engine = engine  # None while the engine is not serving (starting, failed, asleep)
        self._http = http
        self._changed = changed
        self.name = name  # the shard's, for the log
        self.max_loras = max_loras
        self.max_tries = max_tries
        self.backoff_base = backoff_base
        self._clock = clock
        self.adapters: dict[str, _Held] = {}
        self._extra: set[str] = set()  # loaded in the engine, not wanted: to unload
        self._orphans: set[str] = set()  # loads under way of adapters no longer wanted
        self._kick = asyncio.Event()
        self.loads = 0  # loads the engine took, for tests and metrics
        self._verify_at = 0.0  # monotonic: when the engine's list is next read
        self.reloaded = 0  # adapters the engine was found not to hold, and loaded again

    def want(self, adapters: dict[str, str]) -> None:
        """Hold `adapters` (name -> source) from now on."""
        for name in list(self.adapters):
            held = self.adapters[name]
            if adapters.get(name) != held.source:
                self._forget(name)
        for name, source in adapters.items():
            self.adapters.setdefault(name, _Held(source))
        self.kick()

    def _forget(self, name: str) -> None:
        held = self.adapters.pop(name)
        if held.task is not None:
            self._orphans.add(name)  # unloaded once its load is over (`_load`)
        elif held.state is AdapterState.LOADED:
            self._extra.add(name)

    def restarted(self) -> None:
        """The engine was started anew: it holds nothing; load everything again."""
        for held in self.adapters.values():
            if held.task is not None:
                held.task.cancel()
            held.state, held.tries, held.error, held.retry_at, held.task = (
                AdapterState.LOADING,
                0,
                "",
                0.0,
                None,
            )
        self._extra.clear()
        self._orphans.clear()  # their loads went to the engine that is gone
        self.kick()

    def kick(self) -> None:
        """Look again now (the engine became ready, or what is wanted changed)."""
        self._kick.set()

    def check(self) -> None:
        """Read what the engine holds now, not at the next `VERIFY_S`."""
        self._verify_at = 0.0
        self.kick()

    def report(self) -> list[AdapterReport]:
        return [
            AdapterReport(name=name, state=h.state, tries=h.tries, error=h.error)
            for name, h in sorted(self.adapters.items())
        ]

    async def run(self) -> None:
        """Until cancelled: while the engine serves, check what it holds (now and then),
        unload what is not wanted, then load what is wanted and not held (each load its own
        task)."""
        try:
            while True:
                self._kick.clear()
                engine = self._engine()
                wait = None if engine is None else await self._step(engine)
                # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that
                # comes as the kick does, and this loop then never ends (seen in its test).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._kick.wait()
        finally:
            for held in self.adapters.values():
                if held.task is not None:
                    held.task.cancel()

    async def _step(self, engine: EngineAt) -> float | None:
        """One look at a serving engine; returns how long until the next is due (None: when
        a load under way ends, which says so)."""
        loading = any(h.task is not None for h in self.adapters.values()) or self._orphans
        if not loading and self._clock() >= self._verify_at:
            await self._verify(engine)
        for name in sorted(self._extra):
            await self._unload(engine, name)
        now = self._clock()
        waits = [] if loading else [max(0.0, self._verify_at - now)]
        if self._extra:  # an unload failed: retry it before loading anything
            return min([*waits, 1.0])
        taken = len(self._orphans) + sum(
            h.state is AdapterState.LOADED or h.task is not None for h in self.adapters.values()
        )
        for name, held in self.adapters.items():
            if held.state is not AdapterState.LOADING or held.task is not None:
                continue
            if taken >= self.max_loras:
                break  # a slot frees when an orphaned load ends and is unloaded
            if held.retry_at > now:
                waits.append(held.retry_at - now)
                continue
            held.task = asyncio.ensure_future(self._load(engine, name, held))
            taken += 1
        return min(waits, default=None)

    async def _verify(self, engine: EngineAt) -> None:
        """Take what the engine lists as held for the truth (see the module's docstring)."""
        began = self._clock()
        self._verify_at = began + VERIFY_S
        if self.api.listed is None:
            return
        try:
            answer = await self._http.get(
                engine.url + self.api.listed, headers=engine.headers, timeout=10
            )
            listed = answer.json()["data"]
            held = {str(m["id"]) for m in listed if m.get("parent")}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return  # an engine that does not say: nothing to check against
        for name in held - self.adapters.keys():
            self._extra.add(name)
        for name, mine in self.adapters.items():
            gone = mine.state is AdapterState.LOADED and name not in held
            if gone and mine.task is None and mine.loaded_at < began:
                log.warning("shard %s: the engine no longer holds adapter %s; loading it again",
                            self.name, name)  # fmt: skip
                mine.state = AdapterState.LOADING
                self.reloaded += 1
                self._changed()

    async def _unload(self, engine: EngineAt, name: str) -> None:
        status, said = await self._post(engine, self.api.unload, {"lora_name": name})
        if status == 200 or status == 404:  # 404: it held none of that name
            self._extra.discard(name)
            log.info("shard %s: adapter %s unloaded", self.name, name)
        else:
            log.warning("shard %s: unloading adapter %s failed: %s", self.name, name, said)

    async def _load(self, engine: EngineAt, name: str, held: _Held) -> None:
        body = {"lora_name": name, "lora_path": held.source}
        status, said = await self._post(engine, self.api.load, body)
        held.task = None
        if self.adapters.get(name) is not held:  # no longer wanted (or from another source)
            self._orphans.discard(name)
            if status == 200:
                self._extra.add(name)
            self.kick()
            return
        if status == 200 or (status == 400 and "already" in said):
            # "already been loaded": an engine adopted from an earlier agent run holds it.
            held.state, held.error = AdapterState.LOADED, ""
            held.loaded_at = self._clock()
            self.loads += 1
            log.info("shard %s: adapter %s loaded", self.name, name)
        else:
            held.tries += 1
            held.error = said
            if held.tries >= self.max_tries:
                held.state = AdapterState.FAILED
                log.warning("shard %s: adapter %s failed %d times: %s",
                            self.name, name, held.tries, said)  # fmt: skip
            else:
                backoff = min(BACKOFF_MAX_S, self.backoff_base * 2 ** (held.tries - 1))
                held.retry_at = self._clock() + backoff
                log.warning("shard %s: loading adapter %s failed (%s); again in %.1fs",
                            self.name, name, said, backoff)  # fmt: skip
        self._verify_at = 0.0  # what the engine holds now is checked once the loads are done
        self._changed()
        self.kick()

    async def _post(self, engine: EngineAt, path: str, body: dict[str, str]) -> tuple[int, str]:
        """POST `body` to the engine: (status, what it said); status 0 when it did not answer."""
        try:
            answer = await self._http.post(
                engine.url + path, json=body, headers=engine.headers, timeout=60
            )
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
        return answer.status_code, _said(answer)


def _said(answer: httpx.Response) -> str:
    """The engine's message: vLLM's and SGLang's JSON errors, or its text."""
    text = answer.text
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:_ERROR_CHARS]
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])[:_ERROR_CHARS]
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return str(data[key])[:_ERROR_CHARS]
    return text.strip()[:_ERROR_CHARS]
