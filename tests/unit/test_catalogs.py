"""The catalog keeper: atomic swap, versions, persistence, the watched file, rejections."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelfleet.controlplane.catalogs import SETTLE_S, Applied, CatalogKeeper
from modelfleet.core.catalog import CatalogInvalid
from modelfleet.store.sqlite import SqliteStore

ONE = "models:\n  - name: a\n    engine: sim\n"
TWO = ONE + "  - name: b\n    engine: sim\n    replicas: 2\n"
BAD = "models:\n  - name: a\n    engine: vlm\n  - name: c\n    engine: sim\n    replica: 2\n"


def settled(k: CatalogKeeper, now: float) -> Applied | None:
    """`check_file` as the watcher calls it: at `now`, and once more when a change read then
    has settled."""
    first = k.check_file(now)
    return first if first is not None or not k.settling else k.check_file(now + SETTLE_S)


def followed(k: CatalogKeeper, now: float) -> str | None:
    """`follow_file` as the watcher calls it (see `settled`)."""
    first = k.follow_file(now)
    return first if first is not None or not k.settling else k.follow_file(now + SETTLE_S)


def keeper(tmp_path: Path, file: Path | None = None) -> CatalogKeeper:
    """A control plane's keeper with its state dir in `tmp_path`, leading."""
    k = CatalogKeeper(SqliteStore(tmp_path / "store.sqlite"), file, tmp_path / "seen.sha256")
    k.lead(now=1.0)
    return k


def test_versions_grow_by_one_and_an_identical_catalog_is_no_new_version(tmp_path: Path) -> None:
    k = keeper(tmp_path)
    assert k.current.version == 1 and k.current.models == ()
    first = k.apply(ONE, "api", 2.0)
    assert first.changed and first.catalog.version == 2 and first.previous.version == 1
    again = k.apply(ONE, "api", 3.0)
    assert not again.changed and again.catalog is first.catalog
    second = k.apply(TWO, "api", 4.0)
    assert second.catalog.version == 3 and [m.name for m in second.catalog.models] == ["a", "b"]
    history = k.history(10)
    assert [v.version for v in history] == [3, 2, 1]
    assert [v.applied_at for v in history] == [4.0, 2.0, 1.0]
    assert history[0].digest == second.catalog.digest


def test_a_reader_keeps_the_catalog_it_took_across_a_swap(tmp_path: Path) -> None:
    k = keeper(tmp_path)
    k.apply(ONE, "api", 2.0)
    taken = k.current
    k.apply(TWO, "api", 3.0)
    assert [m.name for m in taken.models] == ["a"]  # what the reader took is unchanged
    assert [m.name for m in k.current.models] == ["a", "b"]


def test_an_invalid_catalog_changes_nothing_and_is_recorded(tmp_path: Path) -> None:
    k = keeper(tmp_path)
    k.apply(ONE, "api", 2.0)
    before = k.current
    with pytest.raises(CatalogInvalid) as info:
        k.apply(BAD, "api", 3.0)
    assert len(info.value.problems) == 2
    assert k.current is before
    rejected = k.last_rejection()
    assert rejected is not None and rejected.at == 3.0 and rejected.source == "api"
    assert any("unknown engine 'vlm'" in p for p in rejected.problems)
    assert any("did you mean 'replicas'" in p for p in rejected.problems)
    assert [v.version for v in k.history(10)] == [2, 1]


def test_a_restart_starts_from_the_last_applied_catalog(tmp_path: Path) -> None:
    k = keeper(tmp_path)
    k.apply(TWO, "api", 2.0)
    digest = k.current.digest
    k.store.close()
    restarted = keeper(tmp_path)
    assert restarted.current.version == 2 and restarted.current.digest == digest
    assert restarted.current_info.source == "api"
    assert restarted.apply(ONE, "api", 3.0).catalog.version == 3  # versions go on growing


def test_the_file_is_applied_when_its_content_changes(tmp_path: Path) -> None:
    file = tmp_path / "catalog.yaml"
    file.write_text(ONE)
    k = keeper(tmp_path, file)
    assert k.current.version == 1 and k.current_info.source == str(file)
    assert settled(k, 2.0) is None  # unchanged
    file.write_text(TWO)
    applied = settled(k, 3.0)
    assert applied is not None and applied.changed and applied.catalog.version == 2

    file.write_text(BAD)
    assert settled(k, 4.0) is None
    assert k.current.version == 2
    rejected = k.last_rejection()
    assert rejected is not None and rejected.source == str(file) and len(rejected.problems) == 2

    # An API apply stands until the file changes again; re-reading the same text does not undo it.
    k.apply(ONE, "api", 5.0)
    file.write_text(BAD)  # same content as before, new mtime
    assert settled(k, 6.0) is None and k.current_info.source == "api"
    file.write_text(TWO)
    assert settled(k, 7.0) is not None and k.current_info.source == str(file)


def test_start_prefers_the_store_unless_the_file_changed_meanwhile(tmp_path: Path) -> None:
    file = tmp_path / "catalog.yaml"
    file.write_text(ONE)
    k = keeper(tmp_path, file)
    k.apply(TWO, "api", 2.0)
    k.store.close()
    # The file did not change while the control plane was down: the API's catalog stands.
    k = keeper(tmp_path, file)
    assert k.current.version == 2 and k.current_info.source == "api"
    k.store.close()
    # It did change: the file wins; an invalid file leaves the stored catalog current.
    file.write_text(BAD)
    k = keeper(tmp_path, file)
    assert k.current.version == 2 and k.last_rejection() is not None
    k.store.close()
    file.write_text(ONE + "  - name: z\n    engine: sim\n")
    k = keeper(tmp_path, file)
    assert k.current.version == 3 and [m.name for m in k.current.models] == ["a", "z"]


def test_a_first_start_needs_a_valid_file(tmp_path: Path) -> None:
    file = tmp_path / "catalog.yaml"
    file.write_text(BAD)
    with pytest.raises(CatalogInvalid):
        keeper(tmp_path, file)
    with pytest.raises(OSError):
        keeper(tmp_path / "other", tmp_path / "missing.yaml")


def test_an_api_apply_is_written_to_the_watched_file_and_an_edit_of_it_changes_nothing(
    tmp_path: Path,
) -> None:
    """One source of truth: a comment added to the file after `ctl catalog apply` once
    reverted the applied catalog to what the file held."""
    file = tmp_path / "catalog.yaml"
    file.write_text(ONE)
    k = keeper(tmp_path, file)
    applied = k.apply(TWO, "api", 2.0)
    assert "ctl catalog apply" in file.read_text()
    assert settled(k, 3.0) is None  # its own write is no change
    file.write_text(file.read_text() + "# a comment of the operator's\n")
    commented = settled(k, 4.0)
    assert commented is None or not commented.changed
    assert k.current.version == applied.catalog.version
    assert [m.name for m in k.current.models] == ["a", "b"]
    file.write_text(file.read_text().replace("replicas: 2", "replicas: 3"))
    edited = settled(k, 5.0)
    assert edited is not None and edited.changed and k.current.get("b").replicas == 3  # type: ignore[union-attr]


def test_an_api_apply_writes_the_file_as_applied_with_its_comments_and_one_header(
    tmp_path: Path,
) -> None:
    """The operator's comments and order survive `ctl catalog apply`; a file applied again
    (header and all) does not gather a second header."""
    file = tmp_path / "catalog.yaml"
    file.write_text(ONE)
    k = keeper(tmp_path, file)
    commented = "# the team's models\n" + TWO.replace(
        "replicas: 2", "replicas: 2  # two: the nightly batch"
    )
    first = k.apply(commented, "api", 2.0)
    written = file.read_text()
    assert written.startswith("# Written by `modelfleet ctl catalog apply`: catalog version")
    assert written.endswith(commented)
    assert settled(k, 3.0) is None  # its own write is no change
    again = k.apply(written.replace("replicas: 2", "replicas: 3"), "api", 4.0)
    assert again.changed and again.catalog.version == first.catalog.version + 1
    rewritten = file.read_text()
    assert rewritten.count("# Written by") == 1 and rewritten.count("# Edit this file") == 1
    assert "replicas: 3  # two: the nightly batch" in rewritten
    assert "# the team's models" in rewritten
    restarted = keeper(tmp_path / "fresh", file)  # the file as written is a valid catalog
    assert restarted.current.get("b").replicas == 3  # type: ignore[union-attr]


def host(tmp_path: Path, name: str, store: Path, catalog: str) -> CatalogKeeper:
    """A control plane on a host of its own: its own state dir and catalog file, one store."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "catalog.yaml").write_text(catalog)
    return CatalogKeeper(SqliteStore(store), folder / "catalog.yaml", folder / "seen.sha256")


def test_a_follower_applies_nothing_and_says_when_its_file_holds_another_catalog(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store.sqlite"
    a, b = host(tmp_path, "a", store, ONE), host(tmp_path, "b", store, ONE)
    a.lead(1.0)
    assert followed(b, 1.0) is None  # its file holds the current catalog
    assert b.file is not None
    b.file.write_text(TWO)
    told = followed(b, 2.0)
    assert told is not None and "not applied" in told and "ctl catalog apply" in told
    assert [v.version for v in a.history(10)] == [1] and b.current.version == 1
    assert followed(b, 3.0) is None  # said once


def test_an_api_apply_on_the_leader_stands_through_a_restart_of_the_follower_and_a_failover(
    tmp_path: Path,
) -> None:
    """Issue 38: a follower that restarted wrote its own catalog file into the store, and
    after the next failover the fleet silently ran the old catalog."""
    store = tmp_path / "store.sqlite"
    a, b = host(tmp_path, "a", store, ONE), host(tmp_path, "b", store, ONE)
    a.lead(1.0)
    b.check_start()
    applied = a.apply(TWO, "api", 2.0)
    b.store.close()
    b = CatalogKeeper(SqliteStore(store), b.file, tmp_path / "b" / "seen.sha256")  # restarted
    b.check_start()
    assert [v.version for v in b.history(10)] == [2, 1]  # it wrote nothing
    assert b.lead(3.0) is None  # the failover: b leads, its file unchanged since it read it
    assert b.current.digest == applied.catalog.digest and b.current_info.source == "api"
    assert b.file is not None and b.file.read_text().endswith(TWO)  # the file shows it now
    assert (tmp_path / "b" / "catalog.yaml.replaced").read_text() == ONE
    assert settled(b, 4.0) is None  # and reading it back changes nothing


def test_a_file_edited_while_its_control_plane_was_down_is_applied_when_it_leads(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store.sqlite"
    a = host(tmp_path, "a", store, ONE)
    a.lead(1.0)
    a.store.close()
    assert a.file is not None
    a.file.write_text(TWO)
    again = CatalogKeeper(SqliteStore(store), a.file, tmp_path / "a" / "seen.sha256")
    applied = again.lead(2.0)
    assert applied is not None and applied.changed and again.current.version == 2


def test_a_file_is_read_only_once_it_is_whole(tmp_path: Path) -> None:
    """The watcher read a file half-written (an editor's or a copy's write under way) and
    refused it (a false CatalogRefused); a change is taken once it reads the same, stat and
    content, SETTLE_S apart by the caller's clock."""
    file = tmp_path / "catalog.yaml"
    file.write_text(ONE)
    k = keeper(tmp_path, file)
    half = TWO[: TWO.index("engine: sim\n    replicas") + len("engi")]  # cut mid-key
    file.write_text(half)
    assert k.check_file(2.0) is None
    assert k.last_rejection() is None and k.current.version == 1  # not refused: not read whole
    file.write_text(TWO)  # the write goes on: another read, another content
    assert k.check_file(2.1) is None and k.settling
    assert k.check_file(2.1 + SETTLE_S / 2) is None  # the same, but not long enough apart
    applied = k.check_file(2.1 + SETTLE_S)
    assert applied is not None and applied.catalog.version == 2
    assert k.last_rejection() is None and not k.settling  # nothing was refused
    # A file that stays half-written is refused, once it has settled.
    file.write_text(half)
    assert settled(k, 5.0) is None and k.last_rejection() is not None
