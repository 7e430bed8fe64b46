"""Which catalog is current: one atomic swap, persisted, with its history and the last rejection.

A `Catalog` never changes; `CatalogKeeper.current` is replaced whole by `apply`. A reader takes
`current` once and finishes its work against what it took, so a swap in the middle of its work
is invisible to it. Two ways lead to `apply`: the catalog file (`check_file`, polled by the
control plane) and the admin API. An invalid catalog, from either, changes nothing: it is
recorded as the last rejection and the current catalog stays.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from modelfleet.catalog import Catalog, CatalogInvalid
from modelfleet.files import write_atomic
from modelfleet.store import Rejection, Store, StoredCatalog, StoreError

log = logging.getLogger("modelfleet.controlplane")

API_SOURCE = "api"
_FILE_DIGEST_KEY = "catalog_file_digest"
# The two lines a catalog applied through the API gets on top when written to the file.
_HEADER = (
    "# Written by `modelfleet ctl catalog apply`",
    "# Edit this file or apply another catalog: the newest change wins.",
)


@dataclass(frozen=True)
class Applied:
    """The result of an apply: the catalog now current and whether it is a new version."""

    catalog: Catalog
    changed: bool
    previous: Catalog


@dataclass(frozen=True)
class CurrentCatalog:
    """The current catalog with where and when it was applied."""

    catalog: Catalog
    applied_at: float
    source: str


class CatalogKeeper:
    """Holds the current catalog and is the only thing that replaces it."""

    def __init__(self, store: Store, file: Path | None = None) -> None:
        self.store = store
        self.file = file
        self._file_stat: tuple[int, int, int] | None = None
        self.started: Applied | None = None  # the version `start` applied, if it made one
        latest = store.latest_catalog()
        self._current = _restore(latest) if latest else None

    def reload(self) -> None:
        """Take the store's latest catalog as current: another control plane, leading
        before this one, may have applied a newer one."""
        latest = self.store.latest_catalog()
        if latest is not None:
            self._current = _restore(latest)

    @property
    def current(self) -> Catalog:
        """The current catalog. Take it once per operation."""
        if self._current is None:
            raise RuntimeError("no catalog yet: call start() first")
        return self._current.catalog

    @property
    def current_info(self) -> CurrentCatalog:
        if self._current is None:
            raise RuntimeError("no catalog yet: call start() first")
        return self._current

    def start(self, now: float) -> None:
        """Pick the catalog to start from.

        The last applied catalog in the store, unless the catalog file changed since it was
        last read (or there is none stored): then the file, if it is valid. With nothing stored,
        an invalid or unreadable file is an error (raised), since there is nothing to fall back
        to; with something stored it is recorded as a rejection and the stored one stays.
        No file and nothing stored starts from an empty catalog.
        """
        if self.file is None:
            if self._current is None:
                self._swap(Catalog.new([]), API_SOURCE, now)
            return
        if self._current is None:
            text = self.file.read_text()  # OSError: the caller reports it
            self.started = self._apply_file_text(text, now, strict=True)
        else:
            try:
                self.started = self.check_file(now)
            except OSError as exc:
                log.warning(
                    "catalog file %s unreadable (%s); starting from the store", self.file, exc
                )
        cur = self.current_info
        log.info(
            "catalog version %d (%s) from %s: %d model(s)",
            cur.catalog.version,
            cur.catalog.digest,
            cur.source,
            len(cur.catalog.models),
        )

    def check_file(self, now: float) -> Applied | None:
        """Apply the catalog file if its content changed since it was last read.

        Returns what was applied, or None when the file did not change or was invalid (the
        rejection is recorded and logged). Raises OSError when the file cannot be read.
        """
        if self.file is None:
            return None
        st = os.stat(self.file)
        stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stat == self._file_stat:
            return None
        text = self.file.read_text()
        self._file_stat = stat
        try:
            return self._apply_file_text(text, now, strict=False)
        except StoreError:
            self._file_stat = None  # read again at the next poll, when the store may write
            raise

    def _apply_file_text(self, text: str, now: float, strict: bool) -> Applied | None:
        digest = _text_digest(text)
        if digest == self.store.get_meta(_FILE_DIGEST_KEY) and self._current is not None:
            return None  # this content was read before; an API apply since then stands
        try:
            applied = self.apply(text, str(self.file), now)
        except CatalogInvalid as exc:
            self.store.set_meta(_FILE_DIGEST_KEY, digest)
            if strict:
                raise
            log.error("%s; the current catalog stays", exc)
            return None
        self.store.set_meta(_FILE_DIGEST_KEY, digest)
        return applied

    def validate(self, text: str, source: str) -> Catalog:
        """Parse and validate without applying; raises CatalogInvalid."""
        return Catalog.from_yaml(text, source=source)

    def apply(self, text: str, source: str, now: float) -> Applied:
        """Make the catalog in `text` current, unless it is invalid (raises CatalogInvalid).

        A catalog with the same content as the current one is not a new version.
        """
        try:
            candidate = self.validate(text, source)
        except CatalogInvalid as exc:
            try:
                rejection = Rejection(now, source, tuple(str(p) for p in exc.problems))
                self.store.set_rejection(rejection)
            except StoreError as failed:  # the refusal stands; only its record is missing
                log.warning("cannot record the rejected catalog: %s", failed)
            raise
        previous = self._current.catalog if self._current else Catalog.new([])
        if self._current is not None and candidate.digest == self._current.catalog.digest:
            return Applied(self._current.catalog, False, previous)
        catalog = self._swap(candidate, source, now)
        if source == API_SOURCE and self.file is not None:
            self._write_file(catalog, text, now)
        log.info(
            "catalog version %d (%s) applied from %s: %d model(s)",
            catalog.version,
            catalog.digest,
            source,
            len(catalog.models),
        )
        return Applied(catalog, True, previous)

    def _write_file(self, catalog: Catalog, applied: str, now: float) -> None:
        """Write a catalog applied through the API to the watched file too, atomically, so the
        file and the API are one source of truth: a later edit of the file starts from what is
        current, and the file, read back, changes nothing. The text is written as it was
        applied, comments and order kept, under a header saying so (one header: a file
        applied again does not gather them)."""
        assert self.file is not None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        lines = applied.splitlines(keepends=True)
        while lines and lines[0].startswith(_HEADER):
            lines.pop(0)
        body = "".join(lines)
        text = (
            f"{_HEADER[0]}: catalog version {catalog.version}, {when}.\n{_HEADER[1]}\n"
            + body
            + ("" if body.endswith("\n") else "\n")
        )
        try:
            mode = self.file.stat().st_mode & 0o777 if self.file.exists() else 0o644
            write_atomic(self.file, text, mode)
        except OSError as exc:
            log.error(
                "cannot write the applied catalog to %s (%s): an edit of that file will "
                "start from what it holds, not from catalog version %d",
                self.file,
                exc,
                catalog.version,
            )
            return
        st = os.stat(self.file)
        self._file_stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        self.store.set_meta(_FILE_DIGEST_KEY, _text_digest(text))

    def _swap(self, candidate: Catalog, source: str, now: float) -> Catalog:
        version = self.store.add_catalog(candidate.digest, now, source, candidate.to_dict())
        catalog = candidate.with_version(version)
        self._current = CurrentCatalog(catalog, now, source)  # the one swap
        return catalog

    def history(self, limit: int) -> list[StoredCatalog]:
        return self.store.catalog_history(limit)

    def last_rejection(self) -> Rejection | None:
        return self.store.last_rejection()


def _restore(stored: StoredCatalog) -> CurrentCatalog:
    catalog = Catalog.from_dict(stored.body, version=stored.version, source="the store")
    return CurrentCatalog(catalog, stored.applied_at, stored.source)


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
