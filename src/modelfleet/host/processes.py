"""Processes the fleet starts and stops: ports, identities, log tails, and one way to stop.

Every modelfleet process that starts another (an agent its engines, `up` its fleet, a test its
services) starts it in a process group of its own and ends it through `stop_groups`: SIGTERM to
each group, a grace period, then SIGKILL to what is left. A process is named by its pid and
its start time (`ProcessId`), so a pid the kernel has since given to another process is never
mistaken for the one that was started.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

_PR_SET_PDEATHSIG = 1  # prctl(2)
# How much of a log file `log_tail` reads back from its end.
_TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class ProcessId:
    """One process, for as long as it runs: its pid and when it started (seconds since the
    epoch, as psutil reads it from the kernel). A reused pid has another start time."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The identity of the running process `pid`; None when there is none (or a zombie)."""
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return cls(pid, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def running(self) -> bool:
        """Whether this very process still runs (not one that took over its pid)."""
        now = ProcessId.of(self.pid)
        return now is not None and abs(now.started - self.started) < 0.01


def running(pid: int) -> bool:
    """Whether a process `pid` runs now (an exited child not yet reaped does not)."""
    return ProcessId.of(pid) is not None


def _ephemeral_low() -> int:
    """The lowest port the kernel gives to outgoing connections (32768 unless set otherwise)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Where `free_port` picks, below the kernel's range for outgoing connections: the services
# `up` starts in the upper half, the engines agents start in the lower half, anything else
# anywhere in it.
PortBand = Literal["services", "engines", "any"]


def free_port(host: str, band: PortBand = "any") -> int:
    """A TCP port free on `host` now, for a listener to bind soon after.

    Picked below the kernel's range for outgoing connections: a port from that range, free
    now, may be taken a moment later as the source port of some connection, and the listener
    that was meant to have it fails with "address already in use". `up` picks its services'
    ports before they bind them, and agents pick their engines' ports meanwhile: in bands of
    their own, so that an engine never takes a port promised to a service (it happened).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    first = max(1024, low - 16384)
    middle = (first + low) // 2
    first, last = {"services": (middle, low), "engines": (first, middle)}.get(band, (first, low))
    for _ in range(64):
        port = random.randrange(first, last) if last > first else 0
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen: int = sock.getsockname()[1]
            return chosen
    with socket.socket(family) as sock:  # every pick was taken: let the kernel choose
        sock.bind((host, 0))
        fallback: int = sock.getsockname()[1]
        return fallback


def port_holders(host: str, port: int) -> list[int] | None:
    """None when nothing listens on `host:port`; else the pids of the processes that do (empty
    when they cannot be told). A socket bound with SO_REUSEPORT shares a port with whoever else
    set it, without a word: this is how to find out before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, not LISTEN
    try:
        probe.bind((host, port))
        return None
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    finally:
        probe.close()
    try:
        listening = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return []
    return sorted(
        {
            c.pid
            for c in listening
            if c.pid is not None
            and c.status == psutil.CONN_LISTEN
            and c.laddr
            and c.laddr[1] == port
        }
    )


def die_with_parent(parent: int) -> bool:
    """Have the kernel send this process SIGTERM when its parent dies (PR_SET_PDEATHSIG);
    False when `parent` is not its parent any more (it died before this was asked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() == parent


def log_tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log file (empty when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return list(deque(text.splitlines(), maxlen=lines))


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to the process group led by `pid`; False when it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is a child of ours, so it stops being a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that run (zombies waiting to be reaped do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the common case, without reading every process of the host
    except PermissionError:
        pass  # someone else's process is in it: look
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
    return members


def _gone(pgid: int) -> bool:
    """Whether nothing of the group led by `pgid` runs any more (its leader reaped if ours)."""
    _reap(pgid)
    return not group_members(pgid)


def stop_groups(
    pids: Iterable[int],
    grace: float,
    poll: float = 0.05,
    killed_wait: float = 10.0,
    leaders_only: bool = False,
) -> list[int]:
    """Stop the process groups led by `pids`, every process in them (an engine's workers
    too, also once their leader has exited): SIGTERM, up to `grace` seconds for all of them to
    exit, then SIGKILL to each group that still has any. With `leaders_only`, SIGTERM goes to
    each group's leader alone (to the group where the leader is gone), which ends the rest its
    own way: vLLM's server drains its engine before it stops its workers, and a worker told
    to stop first kills the engine under the requests it was finishing. Returns once every
    process is gone, or `killed_wait` seconds after the SIGKILL (a process stuck in the
    kernel, a GPU driver call, cannot be hurried), with the leaders of the groups that had
    to be killed."""
    pids = [p for p in pids if not _gone(p)]
    for pid in pids:
        if not (leaders_only and _signal(pid, signal.SIGTERM)):
            signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(not _gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(poll)
    killed = [p for p in pids if not _gone(p)]
    for pid in killed:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + killed_wait
    while any(not _gone(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(poll)
    return killed


def _signal(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to `pid` if it runs; False when it does not (gone, or a zombie)."""
    if not running(pid):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_leftovers(leader: int, grace: float) -> list[int]:
    """End what still runs of the process group `leader` led, now that `leader` has exited
    (an engine's workers, orphaned when their server died): nothing when another process
    holds that pid now (a group of that number is then that process's). As `stop_groups`."""
    if running(leader):
        return []
    return stop_groups([leader], grace)
