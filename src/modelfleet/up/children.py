"""The processes `up` starts: each `modelfleet ...` in its own process group, with its log,
its ready file, and one way to stop them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.files import open_private_log, write_json_atomic
from modelfleet.host.processes import ProcessId, log_tail, stop_groups

# Which processes `up` started (role, node, pid and start time), kept in the state dir as they
# start, so that an `up` that follows one that was killed finds them.
CHILDREN_FILE = "fleet.json"
# The order in which a fleet's own processes are stopped: nothing is placed or published once
# the control plane is gone, the agents leave their engines running, the router goes after
# them, and the Redis its limits count in (`up --redis`) last.
STOP_ORDER = ("control-plane", "agent", "router", "redis", "postgres")
# What a later `up` takes over from one that was killed, when it still runs as it should,
# instead of stopping it: the router (so that no client is refused meanwhile) and its Redis.
ADOPTABLE = ("router", "redis")


class UpError(RuntimeError):
    """`up` could not bring the fleet up; the message says which part and why."""


def agent_state_dir(state_dir: Path, node: str) -> Path:
    """Where the agent of `node` keeps its records and engine logs."""
    return state_dir / "agents" / node


class Adopted:
    """A process an earlier `up` started, taken over by this one: what `up` asks of a child
    process (`pid`, `poll`, `wait`, `returncode`), for one it did not start itself."""

    def __init__(self, process: ProcessId) -> None:
        self.process = process
        self.pid = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self.process.running():
            self.returncode = -1  # not our child: its exit status is its parent's to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


@dataclass
class Child:
    """One process `up` started (or adopted); `restart` replaces `proc` with a new run of the
    same command: `modelfleet ARGS`, or `command` for a program of its own (redis-server)."""

    role: str
    node: str | None
    args: list[str]
    env: dict[str, str]
    log: Path
    ready_file: Path | None
    command: list[str] | None = None
    # For a child without a ready file: its ready answer once it serves, else None.
    ready_check: Callable[[], dict[str, Any] | None] | None = None
    proc: subprocess.Popen[bytes] | Adopted = field(init=False)
    label: str = field(init=False, default="")  # the role, or which of its kind it is
    started_at: float = field(init=False, default=0.0)  # monotonic, at the last launch

    def launch(self) -> None:
        """Start the command in its own process group, output appended to the log."""
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        argv = self.command or [sys.executable, "-m", "modelfleet", *self.args]
        with open_private_log(self.log) as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches `up` alone, which stops all in order
                env={**os.environ, **self.env},
            )
        self.started_at = time.monotonic()


@dataclass
class Fleet:
    """The processes `up` started, and how to stop them."""

    state_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(
        self,
        role: str,
        args: list[str],
        node: str | None = None,
        env: dict[str, str] | None = None,
        ready_file: Path | None = None,
        command: list[str] | None = None,
        ready_check: Callable[[], dict[str, Any] | None] | None = None,
        adopt: ProcessId | None = None,
        label: str | None = None,
    ) -> Child:
        """Start `modelfleet ARGS` (or `command`) as a child of the fleet; with `adopt`,
        take that running process as the child instead of starting one. `label` names one
        of several children of one role that run on no node (its log, its key in `pids`)."""
        name = f"{role}-{node}" if node else label or role
        if ready_file is not None:
            args = [*args, "--ready-file", str(ready_file)]
        log = self.state_dir / "logs" / f"{name}.log"
        child = Child(role, node, args, env or {}, log, ready_file, command, ready_check)
        child.label = name
        if adopt is not None:
            child.proc = Adopted(adopt)
            child.started_at = time.monotonic()
        else:
            child.launch()
        self.children.append(child)
        self._record()
        return child

    def _record(self) -> None:
        children = []
        for c in self.children:
            process = ProcessId.of(c.proc.pid)
            if process is not None:
                entry = {"role": c.role, "node": c.node, "pid": c.proc.pid}
                children.append({**entry, "started": process.started})
        write_json_atomic(self.state_dir / CHILDREN_FILE, {"children": children})

    def restart(self, child: Child, timeout: float = 15) -> dict[str, Any]:
        """Stop `child` if it runs (SIGTERM, SIGKILL after 10 s), start it again, wait until
        it is ready; returns its ready file."""
        self.relaunch(child)
        return self.wait_ready(child, timeout)

    def relaunch(self, child: Child) -> None:
        """Stop `child` if it runs (SIGTERM, SIGKILL after 10 s) and start it again, without
        waiting for it to be ready (`ready`)."""
        stop_groups([child.proc.pid], 10.0)
        child.proc.wait()
        child.launch()
        self._record()

    def ready(self, child: Child) -> dict[str, Any] | None:
        """The child's ready file (or its `ready_check`'s answer) once it is ready; None
        while it is still starting; UpError, with its exit and its log's last lines, when it
        exited first."""
        if child.ready_file is not None and child.ready_file.exists():
            ready: dict[str, Any] = json.loads(child.ready_file.read_text())
            return ready
        checked = child.ready_check() if child.ready_check is not None else None
        if checked is not None:
            return checked
        if child.proc.poll() is not None:
            raise UpError(f"{child.role} {exited(child)}")
        return None

    def wait_ready(self, child: Child, timeout: float) -> dict[str, Any]:
        """Wait for the child's ready file (or its `ready_check`); UpError with its log tail
        if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = self.ready(child)
            if ready is not None:
                return ready
            time.sleep(0.05)
        raise UpError(f"{child.role} was not ready within {timeout:.0f}s; see {child.log}")

    def engine_pids(self) -> dict[str, list[int]]:
        """The engines each agent recorded as started, by node."""
        nodes = sorted({c.node for c in self.children if c.node})
        return {n: recorded_engine_pids(agent_state_dir(self.state_dir, n)) for n in nodes}

    def pids(self) -> dict[str, Any]:
        """The pid of each child that runs now (one that exited is left out until it runs
        again) and of each agent's engines."""
        pids: dict[str, Any] = {"agent": {}, "engine": self.engine_pids()}
        for c in self.children:
            if c.proc.poll() is not None:
                continue
            if c.node:
                pids[c.role][c.node] = c.proc.pid
            else:
                pids[c.label or c.role] = c.proc.pid
        return pids

    def stop(self) -> None:
        """Stop everything: control plane, agents, then the engines they left, router last."""
        engines = self.engine_pids()
        for role in STOP_ORDER[:2]:
            stop_groups([c.proc.pid for c in self.children if c.role == role], 10.0)
        engines_now = self.engine_pids()  # the agents may have started more before they stopped
        all_engines = {p for pids in (*engines.values(), *engines_now.values()) for p in pids}
        stop_groups(sorted(all_engines), 15.0)
        for role in STOP_ORDER[2:]:
            stop_groups([c.proc.pid for c in self.children if c.role == role], 10.0)
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.wait()


def exited(child: Child, lines: int = 20) -> str:
    """How `child` ended, in words: its exit code (or signal) and its log's last lines."""
    code = child.proc.returncode
    if isinstance(child.proc, Adopted):
        how = "is gone (adopted from an earlier `up`: its exit status is not ours to read)"
    elif code is not None and code < 0:
        how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    tail = "\n".join(f"  | {line}" for line in log_tail(child.log, lines))
    return (
        f"{how}; the last lines of {child.log}:\n{tail}"
        if tail
        else f"{how} ({child.log} is empty)"
    )


@dataclass
class Leftovers:
    """What an earlier `up` that was killed left running."""

    stopped: list[str]  # in words
    adoptable: dict[str, ProcessId]  # role -> a process of ADOPTABLE, still running


def stop_leftovers(state_dir: Path) -> Leftovers:
    """Stop what an earlier `up` on `state_dir` started and left running when it was killed:
    its control plane and agents (each only if it is that very process still). Their engines
    keep running, for the new agents to adopt; its router and Redis keep running too, for
    the new `up` to adopt or stop (`start_fleet`)."""
    try:
        data = json.loads((state_dir / CHILDREN_FILE).read_text())
        entries = list(data["children"])
    except (OSError, ValueError, KeyError, TypeError):
        return Leftovers([], {})
    left = Leftovers([], {})
    for role in STOP_ORDER:
        pids = []
        for e in entries:
            if e.get("role") != role:
                continue
            process = ProcessId(int(e["pid"]), float(e["started"]))
            if not process.running():
                continue
            if role in ADOPTABLE:
                left.adoptable[role] = process
                continue
            pids.append(process.pid)
            where = f" of {e['node']}" if e.get("node") else ""
            left.stopped.append(f"the {role}{where} (pid {process.pid})")
        stop_groups(pids, 10.0)
    return left
