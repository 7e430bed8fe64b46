"""Engines' logs on the agent's disk: one file per shard, the runs before kept beside it.

Each start of an engine moves its shard's log aside (`rotate`: the run before becomes
`.1`, the one before that `.2`, up to KEEP_RUNS), so the output of the run that crashed
is still there after the restart. `read_log` answers the control plane's `LogRequest`s for
`ctl logs`.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from modelfleet.wire import LogAnswer, LogRequest

KEEP_RUNS = 5
MAX_RUN_BYTES = 10 << 20  # a run's log moved aside is cut to its last 10 MiB
MAX_ANSWER_BYTES = 1 << 20  # what one answer reads at most


def shard_log(folder: Path, replica_id: str, rank: int) -> Path:
    """Where the engine of shard `rank` of `replica_id` writes its output."""
    return folder / f"{replica_id}-{rank}.log"


def rotate(path: Path, keep: int = KEEP_RUNS) -> None:
    """Move `path` (the run before's log) to `path.1`, `.1` to `.2`, ..., dropping what is
    past `keep`; the run moved aside keeps its last MAX_RUN_BYTES."""
    if not path.exists() or path.stat().st_size == 0:
        return
    for k in range(keep - 1, 0, -1):
        older = _run(path, k)
        if older.exists():
            os.replace(older, _run(path, k + 1))
    os.replace(path, _run(path, 1))
    _cut(_run(path, 1), MAX_RUN_BYTES)


def read_log(path: Path, request: LogRequest) -> LogAnswer:
    """The part of the log of `path` (or of a run before it) that `request` asks for."""
    target = path if request.previous == 0 else _run(path, request.previous)
    try:
        with target.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            if request.offset is None:
                f.seek(max(0, end - MAX_ANSWER_BYTES))
                text = f.read().decode(errors="replace")
                return LogAnswer(
                    id=request.id,
                    lines=list(deque(text.splitlines(), maxlen=request.tail)),
                    offset=end,
                )
            start = min(request.offset, end)
            f.seek(start)
            data = f.read(MAX_ANSWER_BYTES)
            # Only whole lines; the rest comes with the next follow.
            whole = data[: data.rfind(b"\n") + 1] if len(data) == MAX_ANSWER_BYTES else data
            text = whole.decode(errors="replace")
            return LogAnswer(id=request.id, lines=text.splitlines(), offset=start + len(whole))
    except FileNotFoundError:
        run = "its current run" if request.previous == 0 else f"run -{request.previous}"
        return LogAnswer(id=request.id, error=f"no log of {run} on this node")
    except OSError as exc:
        return LogAnswer(id=request.id, error=f"cannot read {target.name}: {exc}")


def _run(path: Path, k: int) -> Path:
    return path.with_name(f"{path.name}.{k}")


def _cut(path: Path, keep: int) -> None:
    size = path.stat().st_size
    if size <= keep:
        return
    with path.open("rb") as f:
        f.seek(size - keep)
        tail = f.read()
    with path.open("wb") as f:
        f.write(tail)
