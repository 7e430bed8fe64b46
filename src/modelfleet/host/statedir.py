"""One owner per state dir: a lock that a second process on the same folder cannot take.

The control plane (its store), each agent (its records of engines) and `up` (its fleet) lock
their state dir for as long as they run. The kernel releases the lock when its holder exits,
however it exits, so a process killed with -9 leaves no stale lock behind; the lock file keeps
the last holder's pid and role, for the message a second one gets.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

from modelfleet.host.files import private_dir

LOCK_FILE = "lock"
INSTANCE_FILE = "instance-id"


class StateDirBusy(RuntimeError):
    """Another process owns the state dir; the message names it."""


class StateDirLock:
    """An exclusive lock on a state dir, held until `release` or the process's exit."""

    def __init__(self, folder: Path, role: str) -> None:
        self.folder = folder
        self.role = role
        self._fd: int | None = None

    def acquire(self) -> StateDirLock:
        """Take the lock; StateDirBusy naming the holder when another process has it."""
        private_dir(self.folder)
        path = self.folder / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StateDirBusy(
                f"{self.folder} is in use by {holder}; stop it first, or give this "
                f"{self.role} a state dir of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{self.role} pid {os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None


def instance_id(folder: Path) -> str:
    """A random id of this state dir, made at its first use and kept in it: what tells apart
    two processes whose host name and state dir path are the same (cloned machines with the
    default state dir). Raises OSError when the folder cannot be read or written."""
    path = folder / INSTANCE_FILE
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept
    made = secrets.token_hex(6)
    private_dir(folder)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(made + "\n")
        f.flush()
        os.fsync(f.fileno())
    return made
