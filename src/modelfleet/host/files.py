"""Writing the files modelfleet keeps: whole or not at all, and private where they hold secrets.

A reader sees the old file or the new one, never half of one: each is written to a temporary
file beside it, flushed to disk, and renamed over it. Files that hold a credential (tokens, API
keys, engine keys) are created readable by their owner alone (0600), in folders only their
owner can enter (0700): a state dir is private as a whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

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
