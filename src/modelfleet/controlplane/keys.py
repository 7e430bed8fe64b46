"""The client API keys the control plane manages while the fleet runs.

A key is shown once, when it is made; the store and the routers know only its SHA-256. Every
change (a key made, its limits or models changed, a key revoked) is written to the store
first and then published with the routing table, so every router has it within one push.
Every refusal is a `KeyRefused` carrying the HTTP status the admin API answers, and leaves
the keys as they were.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from modelfleet.core.catalog import Catalog
from modelfleet.core.units import MAX_DURATION, BadDuration, parse_duration
from modelfleet.messages import admin
from modelfleet.messages.wire import RoutedKey
from modelfleet.security.apikeys import hash_key, new_key
from modelfleet.store import Once, StoredKey
from modelfleet.store.calls import StoreCalls

_EXPIRY_DATE = re.compile(admin.EXPIRY_DATE_PATTERN)
PREFIX_CHARS = 8  # of the key, after `mf-`, shown by `ctl keys list` to tell keys apart


class KeyRefused(Exception):
    """A key change refused: what is wrong, and the status the admin API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_expiry(text: str, now: float) -> float:
    """When a key given `--expires TEXT` at wall time `now` expires, in wall seconds.

    TEXT is a duration from now (`90s`, `30m`, `12h`, `30d`, `2w`) or an ISO 8601 date or
    time (`2027-01-31`, `2027-01-31T12:00:00+00:00`; UTC when it names no zone).
    """
    try:
        seconds: float | None = parse_duration(text, clamp=True)  # past 100 years: 100 years
    except BadDuration:
        seconds = None
    if seconds is not None:
        if seconds <= 0:
            raise KeyRefused(400, f"expires: {text!r} is not after now")
        return now + seconds
    if not _EXPIRY_DATE.match(text):  # the forms the document states (`admin.Expires`)
        raise KeyRefused(
            400,
            f"expires: {text!r} is neither a duration (90s, 30m, 12h, 30d, 2w) nor an "
            "ISO 8601 date or time (2027-01-31, 2027-01-31T12:00, 2027-01-31T12:00:00Z)",
        )
    when = datetime.fromisoformat(text.strip())
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    at = when.timestamp()
    if at <= now:
        # Well formed, as the document says, and past by the clock: a conflict with now.
        raise KeyRefused(409, f"expires: {text!r} is in the past")
    return min(at, now + MAX_DURATION)  # as a duration: a date past 100 years is 100 years


def info(key: StoredKey, used: tuple[int, int, float] | None = None) -> admin.KeyInfo:
    """What `ctl keys` shows of a key, with its usage so far: (requests, tokens, last used)."""
    requests, tokens, last = used if used is not None else (0, 0, None)
    return admin.KeyInfo(
        requests=requests,
        tokens=tokens,
        last_used_at=last,
        name=key.name,
        prefix=key.prefix,
        models=list(key.models) if key.models is not None else None,
        rpm=key.rpm,
        tpm=key.tpm,
        max_concurrent=key.max_concurrent,
        created_at=key.created_at,
        expires_at=key.expires_at,
    )


# What follows a key change besides the memory: its event, the routers told.
Done = Callable[[StoredKey], None]


def _nothing(_: StoredKey) -> None:
    pass


class KeyBook:
    """The managed keys: the store's, with a copy in memory for publishing. Each change is
    written to the store first (off the event loop, through `calls`), then kept in memory and
    `done`; a change with a request id (`once`) whose write answered late is kept and done
    when it lands (`StoreCalls.change`)."""

    def __init__(self, calls: StoreCalls, keys: Iterable[StoredKey] = ()) -> None:
        self.calls = calls
        self.store = calls.store
        self.keys = {k.name: k for k in keys}
        self.writing = asyncio.Lock()  # one change at a time: each checks what the last made

    async def _write(
        self, work: Callable[[], None], once: Once | None, kept: Callable[[], None]
    ) -> None:
        """`work` (a write of the store), then `kept()`; with `once`, `kept()` also when the
        write lands after its answer said it may have."""
        if once is None:
            await self.calls(work)
        else:
            await self.calls.change(work, once.id, lambda _: kept())
        kept()

    async def _create(
        self,
        request: admin.KeyCreate,
        names: Mapping[str, str],
        now: float,
        once: Once | None = None,
        done: Done = _nothing,
    ) -> tuple[str, StoredKey]:
        """Make a key; returns the key itself (shown once) and what is stored of it."""
        if request.name in self.keys:
            raise KeyRefused(409, f"a key named {request.name!r} exists; choose another name")
        models = _known(request.models, names)
        key = new_key()
        stored = StoredKey(
            name=request.name,
            sha256=hash_key(key),
            prefix=key[: 3 + PREFIX_CHARS],
            models=models,
            rpm=request.rpm,
            tpm=request.tpm,
            max_concurrent=request.max_concurrent,
            created_at=now,
            expires_at=parse_expiry(request.expires, now) if request.expires else None,
        )

        def kept() -> None:
            self.keys[stored.name] = stored
            done(stored)

        await self._write(lambda: self.store.put_key(stored, once), once, kept)
        return key, stored

    async def _update(
        self,
        name: str,
        request: admin.KeyUpdate,
        names: Mapping[str, str],
        now: float,
        once: Once | None = None,
        done: Done = _nothing,
    ) -> StoredKey:
        """Change a key's models, limits or expiry; what the request leaves out stays."""
        old = self._get(name)
        models = _known(request.models, names)
        given = request.model_dump(exclude_unset=True, exclude={"clear"})
        overlap = set(given) & set(request.clear)
        if overlap:
            raise KeyRefused(400, f"{', '.join(sorted(overlap))}: both set and cleared")
        changed: dict[str, Any] = {}
        for cleared in request.clear:
            changed["expires_at" if cleared == "expires" else cleared] = None
        for field, value in given.items():
            if field == "expires":
                changed["expires_at"] = parse_expiry(value, now) if value is not None else None
            elif field == "models":
                changed["models"] = models
            else:
                changed[field] = value
        new = dataclasses.replace(old, **changed)

        def kept() -> None:
            self.keys[name] = new
            done(new)

        await self._write(lambda: self.store.put_key(new, once), once, kept)
        return new

    async def _revoke(
        self, name: str, once: Once | None = None, done: Done = _nothing
    ) -> StoredKey:
        """Delete a key: no router takes it after its next push."""
        old = self._get(name)

        def kept() -> None:
            self.keys.pop(name, None)
            done(old)

        await self._write(lambda: self.store.delete_key(name, once), once, kept)
        return old

    async def create(
        self,
        request: admin.KeyCreate,
        names: Mapping[str, str],
        now: float,
        once: Once | None = None,
        done: Done = _nothing,
    ) -> tuple[str, StoredKey]:
        """Make a key; returns the key itself (shown once) and what is stored of it."""
        async with self.writing:
            return await self._create(request, names, now, once, done)

    async def update(
        self,
        name: str,
        request: admin.KeyUpdate,
        names: Mapping[str, str],
        now: float,
        once: Once | None = None,
        done: Done = _nothing,
    ) -> StoredKey:
        """Change a key's models, limits or expiry; what the request leaves out stays."""
        async with self.writing:
            return await self._update(name, request, names, now, once, done)

    async def revoke(self, name: str, once: Once | None = None, done: Done = _nothing) -> StoredKey:
        """Delete a key: no router takes it after its next push."""
        async with self.writing:
            return await self._revoke(name, once, done)

    def routed(self) -> list[RoutedKey]:
        """The keys as routers take them, in name order."""
        return [
            RoutedKey(
                name=k.name,
                sha256=k.sha256,
                models=list(k.models) if k.models is not None else None,
                rpm=k.rpm,
                tpm=k.tpm,
                max_concurrent=k.max_concurrent,
                expires_at=k.expires_at,
            )
            for k in sorted(self.keys.values(), key=lambda k: k.name)
        ]

    def _get(self, name: str) -> StoredKey:
        try:
            return self.keys[name]
        except KeyError:
            known = ", ".join(sorted(self.keys)) or "there are none"
            raise KeyRefused(404, f"no key named {name!r} (keys: {known})") from None


def key_names(catalog: Catalog) -> dict[str, str]:
    """The names a key's `models` may list, each to the name a router knows it by: every
    model, every LoRA adapter, and an adapter as "base:adapter" too (a request names it
    either way; the router checks the key against the adapter's name)."""
    names = {m.name: m.name for m in catalog.models}
    for m in catalog.models:
        for a in m.adapters:
            names[a.name] = names[f"{m.name}:{a.name}"] = a.name
    return names


def _known(asked: list[str] | None, names: Mapping[str, str]) -> tuple[str, ...] | None:
    """`asked` as a key holds them (an adapter by its own name), or KeyRefused naming
    those the catalog does not have."""
    if asked is None:
        return None
    unknown = [m for m in asked if m not in names]
    if unknown:
        have = ", ".join(sorted(set(names.values()))) or "none"
        # 409: well formed, as the document says, but not what the catalog holds now.
        raise KeyRefused(
            409,
            f"models: {', '.join(unknown)} not in the catalog (its models and adapters: {have})",
        )
    return tuple(names[m] for m in asked)
