"""A shard's engine taken over from an earlier run of this agent (killed, or restarted), from
the record it kept (`records.py`): only that very process, still running."""

from __future__ import annotations

from typing import Protocol

from modelfleet.agent.records import EngineRecord
from modelfleet.host.processes import ProcessId


class EngineProcess(Protocol):
    """A running engine: `subprocess.Popen`, or `Adopted` for one an earlier agent started."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class Adopted:
    """An engine started by an earlier run of this agent. It is not this process's child, so
    its exit is seen by its identity no longer running, and its exit code is unknown (-1)."""

    def __init__(self, process: ProcessId) -> None:
        self.process = process
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        if self.returncode is None and not self.process.running():
            self.returncode = -1
        return self.returncode


def still_running(record: EngineRecord) -> Adopted | None:
    """The engine `record` describes, if that very process still runs (a pid now used by
    another process does not count: its start time differs)."""
    if record.pid is None or record.process_started is None:
        return None
    process = ProcessId(record.pid, record.process_started)
    return Adopted(process) if process.running() else None
