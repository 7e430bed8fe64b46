"""What an agent keeps in its state dir of the engines it started: `shards.json`.

A record names the engine's process (pid and start time), where it listens and what it was
started for, so that a later run of the agent can take the engine over instead of starting it
again. `up` reads the same records, through `recorded_engine_pids`, to stop the engines an
agent left behind when the whole fleet stops.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from modelfleet.host.files import write_json_atomic
from modelfleet.messages.wire import ShardAssignment, ShardState

log = logging.getLogger("modelfleet.agent")

RECORDS_FILE = "shards.json"


class EngineRecord(BaseModel):
    """One engine the agent started, as its state dir keeps it."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    assignment: ShardAssignment
    pid: int | None = None
    process_started: float | None = None  # the process's start time (psutil's create_time)
    port: int | None = None
    local_port: int | None = None  # behind a gate (`gate.py`): the engine's own, on loopback
    dist_port: int | None = None
    argv: list[str] = []
    health_path: str | None = "/health"
    started_at: float = 0.0  # wall clock, when the agent started it
    ready_at: float | None = None  # wall clock, when it was first ready: no startup timeout after
    engine_key: str | None = None  # the key it was started with (this file is its owner's alone)
    restarts: int = 0
    state: ShardState = ShardState.STARTING


class _RecordsFile(BaseModel):
    shards: dict[str, EngineRecord]


def read_records(state_dir: Path) -> dict[str, EngineRecord]:
    """The records in `state_dir`, by shard key; empty when there are none or they cannot be
    read (logged: adopting nothing is safe, the control plane assigns the shards again)."""
    path = state_dir / RECORDS_FILE
    try:
        return _RecordsFile.model_validate_json(path.read_bytes()).shards
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, ValidationError) as exc:
        log.warning("cannot read %s (%s); adopting nothing", path, exc)
        return {}


def write_records(state_dir: Path, records: dict[str, EngineRecord]) -> None:
    """Replace the records in `state_dir` atomically."""
    data = _RecordsFile(shards=records).model_dump(mode="json")
    write_json_atomic(state_dir / RECORDS_FILE, data)


def recorded_engine_pids(state_dir: Path) -> list[int]:
    """The pids of the engines an agent with `state_dir` recorded as started."""
    return sorted(r.pid for r in read_records(state_dir).values() if r.pid is not None)
