"""Writing the files modelfleet keeps: whole or not at all, and private where they hold secrets.

A reader sees the old file or the new one, never half of one: each is written to a temporary
file beside it, flushed to disk, and renamed over it. Files that hold a credential (tokens, API
keys, engine keys) are created readable by their owner alone (0600), in folders only their
owner can enter (0700): a state dir is private as a whole.

A process's private folder in the system's temp dir (`owned_temp_dir`) is named with its
owner's pid and start time, so that a later process finds those whose owner is gone (killed
-9 before it could remove its own) and removes them, with the secrets they held.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from modelfleet.host.processes import ProcessId

PRIVATE = 0o600
PRIVATE_DIR = 0o700


def private_dir(folder: Path) -> Path:
    """Make `folder` and its missing parents, each enterable by its owner alone, and leave
    `folder` so too (parents that were there already keep their mode)."""
    missing = [folder, *(p for p in folder.parents if not p.exists())]
    for path in reversed(missing):
        path.mkdir(exist_ok=True, mode=PRIVATE_DIR)
        if path is not folder:
            os.chmod(path, PRIVATE_DIR)
    os.chmod(folder, PRIVATE_DIR)
    return folder


def write_atomic(path: Path, text: str, mode: int = PRIVATE, durable: bool = True) -> None:
    """Replace `path` with `text` atomically (a reader sees the old text or the new), created
    with `mode`; `durable` makes it survive a crash of the host too, at two fsyncs."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the mode os.open was given is narrowed by the umask only
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if not durable:
        return
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def write_json_atomic(path: Path, data: Any, mode: int = PRIVATE) -> None:
    """`data` as JSON, written as `write_atomic` writes."""
    write_atomic(path, json.dumps(data, indent=2) + "\n", mode)


def open_private_log(path: Path) -> BinaryIO:
    """`path` opened to append to, made (with its missing folders) readable by its owner
    alone: a process's output may hold paths, addresses and what an engine prints."""
    private_dir(path.parent)
    return open(path, "ab", opener=lambda name, flags: os.open(name, flags, PRIVATE))


# PREFIX<pid>-<start time, s>-<random>: `owned_temp_dir`'s folders.
_OWNED = re.compile(r"(\d+)-(\d+\.\d\d)-[0-9a-f]+")


def owned_temp_dir(prefix: str, root: Path | None = None) -> Path:
    """A new private folder (0700) in `root` (the system's temp dir) for this process, named
    `PREFIX<pid>-<start time>-<random>`; first removes every folder of `prefix` there, of this
    user, whose process no longer runs. Its owner removes it when it stops."""
    parent = root or Path(tempfile.gettempdir())
    sweep_owned(prefix, parent)
    me = ProcessId.of(os.getpid())
    assert me is not None  # this process runs
    folder = parent / f"{prefix}{me.pid}-{me.started:.2f}-{secrets.token_hex(4)}"
    folder.mkdir(mode=PRIVATE_DIR)
    os.chmod(folder, PRIVATE_DIR)
    return folder


def sweep_owned(prefix: str, parent: Path | None = None) -> list[Path]:
    """Remove the folders `owned_temp_dir(prefix)` made in `parent` (the system's temp dir)
    for processes of this user that no longer run; returns them. A pid taken since by
    another process is told apart by its start time."""
    parent = parent or Path(tempfile.gettempdir())
    removed = []
    for folder in parent.glob(f"{prefix}*"):
        found = _OWNED.fullmatch(folder.name[len(prefix) :])
        try:
            mine = not folder.is_symlink() and folder.is_dir()
            mine = mine and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if found is None or not mine:
            continue
        if ProcessId(int(found[1]), float(found[2])).running():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
