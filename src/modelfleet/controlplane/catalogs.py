"""Which catalog is current: one atomic swap, persisted, with its history and the last rejection.

A `Catalog` never changes; `CatalogKeeper.current` is replaced whole by `apply`. A reader takes
`current` once and finishes its work against what it took, so a swap in the middle of its work
is invisible to it. Two ways lead to `apply`: the catalog file (`check_file`, polled by the
control plane) and the admin API. An invalid catalog, from either, changes nothing: it is
recorded as the last rejection and the current catalog stays.

Only a control plane that leads applies a catalog, its writes fenced to its term: a follower
applies nothing, not even its own catalog file, and reads the store's (`reload`). Each
control plane keeps, in its own state dir, the digest of its file's content as it last read
or wrote it (`seen`): when it takes the lead (`lead`) its file is applied only if it changed
since then (an edit made while it was down), so another control plane's catalog, applied
since through the API, is not undone by a file that merely lagged behind. A file that holds
another catalog than the current one is rewritten with the current one, its content kept
beside it (`.replaced`), so that an edit starts from what is current.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.host.files import write_atomic
from modelfleet.store import Once, Rejection, Store, StoredCatalog, StoreError

log = logging.getLogger("modelfleet.controlplane")

API_SOURCE = "api"
# A changed catalog file is read once it reads the same (size, mtime and content) twice this
# long apart, by the caller's clock: an editor's or a copy's write under way is not taken
# half-written (a false refusal). A file written whole and renamed into place waits as long.
SETTLE_S = 0.2
# The first line of a catalog file modelfleet wrote, and the line after it.
_WRITTEN = "# Written by "
_EDIT = "# Edit this file or apply another catalog: the newest change wins."


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
    text: str | None = None  # what it was applied from, as the store keeps it


class CatalogKeeper:
    """Holds the current catalog and is the only thing that replaces it."""

    def __init__(
        self,
        store: Store,
        file: Path | None = None,
        seen: Path | None = None,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.store = store
        self.file = file
        self.seen = seen  # where the digest of the file's content last read is kept
        self.settle_s = settle_s
        self._file_stat: tuple[int, int, int] | None = None
        # A change of the file read once, not yet twice the same: (its stat, its digest),
        # and when it was first read so (the caller's clock).
        self._settling: tuple[tuple[tuple[int, int, int], str], float] | None = None
        self._seen_digest = _read_digest(seen)
        self._current: CurrentCatalog | None = None
        self._rejection: Rejection | None = None
        # Its calls run in worker threads (the store's calls are off the event loop): one at
        # a time, so that two applies never race. Reading `current` takes no lock.
        self._lock = threading.RLock()
        self.reload()

    def reload(self) -> None:
        """Take the store's latest catalog (and last rejection) as current: another control
        plane may have applied a newer one (a follower's reads, a new term)."""
        with self._lock:
            latest = self.store.latest_catalog()
            if latest is not None:
                self._current = _restore(latest)
            self._rejection = self.store.last_rejection()

    @property
    def current(self) -> Catalog:
        """The current catalog. Take it once per operation."""
        return self.current_info.catalog

    @property
    def current_info(self) -> CurrentCatalog:
        if self._current is None:
            return CurrentCatalog(Catalog.new([]), 0.0, "nothing applied yet")
        return self._current

    @property
    def has_catalog(self) -> bool:
        """Whether any catalog was ever applied to the store (as this one last read it)."""
        return self._current is not None

    def check_start(self) -> None:
        """At the start of the process, before it knows whether it leads. Applies nothing.

        With nothing in the store, the catalog file must be there and valid (raises OSError
        or CatalogInvalid): there is nothing else to start from. A control plane new to a
        store that holds a catalog takes its file as read: the store's catalog stands, and
        only an edit made from now on is applied when this one leads.
        """
        if self.file is None:
            return
        if self._current is None:
            self.validate(self.file.read_text(), str(self.file))
        elif self._seen_digest is None:
            try:
                self._note_seen(self.file.read_text())
            except OSError as exc:
                log.warning(
                    "catalog file %s unreadable (%s); the store's catalog stands", self.file, exc
                )

    def _lead_unlocked(self, now: float) -> Applied | None:
        self.reload()
        if self.file is None:
            if self._current is None:
                return self._apply_new("models: []\n", API_SOURCE, now, write_file=False)
            return None
        try:
            text = self._read_file()
        except OSError as exc:
            if self._current is None:
                raise
            log.warning(
                "catalog file %s unreadable (%s); the store's catalog stays", self.file, exc
            )
            return None
        if self._current is None or _text_digest(text) != self._seen_digest:
            return self._apply_file_text(text, now, strict=self._current is None)
        self._mirror(text, now)
        return None

    def _check_file_unlocked(self, now: float) -> Applied | None:
        text = self._changed_text(now)
        if text is None:
            return None
        try:
            return self._apply_file_text(text, now, strict=False)
        except StoreError:
            self._file_stat = None
            raise

    def _follow_file_unlocked(self, now: float) -> str | None:
        text = self._changed_text(now)
        if text is None:
            return None
        self._note_seen(text)
        self.reload()
        try:
            candidate = self.validate(text, str(self.file))
        except CatalogInvalid:
            return (
                f"catalog file {self.file} changed and is invalid; not applied either way: "
                "this control plane follows"
            )
        if candidate.digest == self.current.digest:
            return None  # the leader wrote what is current, or an edit that changes nothing
        return (
            f"catalog file {self.file} changed while this control plane follows: not applied "
            "(only the leader applies a catalog; when this one takes the lead, the file is made "
            f"to hold the current catalog). Apply it with `modelfleet ctl catalog apply "
            f"{self.file}`, or edit the leading control plane's file"
        )

    def lead(self, now: float) -> Applied | None:
        """This control plane leads now: take the store's latest catalog, then apply the file
        if nothing is stored or the file changed since this control plane last read it;
        otherwise make the file hold the current catalog. Returns what was applied, if
        anything. Raises StoreError; with nothing stored, CatalogInvalid or OSError too."""
        with self._lock:
            return self._lead_unlocked(now)

    def check_file(self, now: float) -> Applied | None:
        """While leading: apply the catalog file if its content changed since it was last
        read and has settled (`now`: the caller's clock). Returns what was
        applied, or None when the file did not change, is still settling, or was invalid
        (the rejection is recorded and logged). Raises OSError when the file cannot be read,
        StoreError when the store cannot write (read again at the next call)."""
        with self._lock:
            return self._check_file_unlocked(now)

    def follow_file(self, now: float) -> str | None:
        """While following: note a change of the catalog file (once settled, as for
        `check_file`), applying nothing. Returns what to tell the operator when it holds a
        catalog other than the store's current one (an edit that only the leader could
        apply); None when there is nothing to tell. Raises OSError, StoreError."""
        with self._lock:
            return self._follow_file_unlocked(now)

    def apply(self, text: str, source: str, now: float, once: Once | None = None) -> Applied:
        """Make the catalog in `text` current, unless it is invalid (raises CatalogInvalid).
        A catalog with the same content as the current one is not a new version. `once`:
        its request id, recorded with the new version (AlreadyMade if it was before)."""
        with self._lock:
            return self._apply_unlocked(text, source, now, once)

    def _read_file(self) -> str:
        assert self.file is not None
        st = os.stat(self.file)
        text = self.file.read_text()
        self._file_stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        return text

    @property
    def settling(self) -> bool:
        """Whether a change of the file waits to be read the same once more."""
        return self._settling is not None

    def _changed_text(self, now: float) -> str | None:
        """The file's text if it changed (by its stat, then its digest) since it was last
        read and has settled (read the same, stat and content, SETTLE_S apart by `now`: a
        write under way is not taken), else None."""
        if self.file is None:
            return None
        st = os.stat(self.file)
        stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stat == self._file_stat:
            self._settling = None
            return None
        text = self.file.read_text()
        read = (stat, _text_digest(text))
        if self._settling is None or self._settling[0] != read:
            self._settling = (read, now)
            return None
        if now - self._settling[1] < self.settle_s:
            return None
        self._settling = None
        self._file_stat = stat
        return None if read[1] == self._seen_digest else text

    def _note_seen(self, text: str) -> None:
        self._seen_digest = _text_digest(text)
        if self.seen is not None:
            try:
                write_atomic(self.seen, self._seen_digest + "\n")
            except OSError as exc:  # read again, and applied again (the same: no change)
                log.warning("cannot record the catalog file's digest in %s: %s", self.seen, exc)

    def _apply_file_text(self, text: str, now: float, strict: bool) -> Applied | None:
        try:
            applied = self._apply_unlocked(text, str(self.file), now)
        except CatalogInvalid as exc:
            self._note_seen(text)
            if strict:
                raise
            log.error("%s; the current catalog stays", exc)
            return None
        self._note_seen(text)
        return applied

    def _mirror(self, text: str, now: float) -> None:
        """Make the file hold the current catalog when it holds another (it lagged behind an
        apply made through another control plane, or was edited while this one followed);
        what it held is kept beside it."""
        assert self.file is not None and self._current is not None
        try:
            held = self.validate(text, str(self.file)).digest
        except CatalogInvalid:
            held = None
        if held == self.current.digest:
            return
        kept = self.file.with_name(self.file.name + ".replaced")
        try:
            write_atomic(kept, text, self.file.stat().st_mode & 0o777)
        except OSError as exc:
            log.error("cannot keep %s's content in %s (%s): left as it is", self.file, kept, exc)
            return
        cur = self._current
        self._write_file(cur.catalog, cur.text or cur.catalog.to_yaml(), now, "taking the lead")
        log.warning(
            "catalog file %s held another catalog than the current one (version %d, from %s): "
            "it holds the current one now; what it held is in %s",
            self.file,
            cur.catalog.version,
            cur.source,
            kept,
        )

    def validate(self, text: str, source: str) -> Catalog:
        """Parse and validate without applying; raises CatalogInvalid."""
        return Catalog.from_yaml(text, source=source)

    def _apply_unlocked(
        self, text: str, source: str, now: float, once: Once | None = None
    ) -> Applied:
        try:
            candidate = self.validate(text, source)
        except CatalogInvalid as exc:
            rejection = Rejection(now, source, tuple(str(p) for p in exc.problems))
            self._rejection = rejection
            try:
                self.store.set_rejection(rejection)
            except StoreError as failed:  # the refusal stands; only its record is missing
                log.warning("cannot record the rejected catalog: %s", failed)
            raise
        previous = self.current
        if self._current is not None and candidate.digest == self._current.catalog.digest:
            return Applied(self._current.catalog, False, previous)
        return self._apply_new(text, source, now, candidate=candidate, once=once)

    def _apply_new(
        self,
        text: str,
        source: str,
        now: float,
        candidate: Catalog | None = None,
        write_file: bool = True,
        once: Once | None = None,
    ) -> Applied:
        previous = self.current
        catalog = self._swap(candidate or self.validate(text, source), source, now, text, once)
        if source == API_SOURCE and self.file is not None and write_file:
            self._write_file(catalog, text, now, "`modelfleet ctl catalog apply`")
        log.info(
            "catalog version %d (%s) applied from %s: %d model(s)",
            catalog.version,
            catalog.digest,
            source,
            len(catalog.models),
        )
        return Applied(catalog, True, previous)

    def _write_file(self, catalog: Catalog, applied: str, now: float, by: str) -> None:
        """Write a catalog to the watched file too, atomically, so the file and the API are
        one source of truth: a later edit of the file starts from what is current, and the
        file, read back, changes nothing. The text is written as it was applied, comments and
        order kept, under a header saying so (one header: a file applied again does not
        gather them)."""
        assert self.file is not None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        lines = applied.splitlines(keepends=True)
        while lines and lines[0].startswith((_WRITTEN, _EDIT)):
            lines.pop(0)
        body = "".join(lines)
        text = (
            f"{_WRITTEN}{by}: catalog version {catalog.version}, {when}.\n{_EDIT}\n"
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
        self._note_seen(text)

    def _swap(
        self, candidate: Catalog, source: str, now: float, text: str | None, once: Once | None
    ) -> Catalog:
        body = candidate.to_dict()
        version = self.store.add_catalog(candidate.digest, now, source, body, text, once)
        catalog = candidate.with_version(version)
        self._current = CurrentCatalog(catalog, now, source, text)  # the one swap
        return catalog

    def history(self, limit: int) -> list[StoredCatalog]:
        return self.store.catalog_history(limit)

    def last_rejection(self) -> Rejection | None:
        """The last catalog refused, as this control plane last read or made it."""
        return self._rejection


def _restore(stored: StoredCatalog) -> CurrentCatalog:
    catalog = Catalog.from_dict(stored.body, version=stored.version, source="the store")
    return CurrentCatalog(catalog, stored.applied_at, stored.source, stored.text)


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_digest(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s): the catalog file counts as changed", path, exc)
        return None
