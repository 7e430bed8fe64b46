"""Engines' logs on the agent's disk: one file per shard, the runs before kept beside it.

Each start of an engine moves its shard's log aside (`rotate`: the run before becomes
`.1`, the one before that `.2`, up to KEEP_RUNS), so the output of the run that crashed
is still there after the restart. `read_log` answers the control plane's `LogRequest`s for
`ctl logs`.

An engine's output carries no times the agent could rely on, so the agent notes beside each
log where it stood when (`LogMarks`: wall time and size, at most once a second while it
grows, in `<log>.marks`). `ctl logs --since 10m` starts from the last mark at or before then:
never later than asked, at most about a second earlier.
"""

from __future__ import annotations

import math
import os
import re
from collections import deque
from pathlib import Path
from typing import BinaryIO

from modelfleet.host.files import PRIVATE
from modelfleet.messages.wire import LogAnswer, LogRequest

KEEP_RUNS = 5
MAX_RUN_BYTES = 10 << 20  # a run's log moved aside is cut to its last 10 MiB
MAX_ANSWER_BYTES = 1 << 20  # what one answer reads at most
MARK_EVERY_S = 1.0
MAX_MARKS_BYTES = 1 << 20  # past this the oldest half of a log's marks go


def shard_log(folder: Path, replica_id: str, rank: int) -> Path:
    """Where the engine of shard `rank` of `replica_id` writes its output."""
    return folder / f"{replica_id}-{rank}.log"


def marks_of(path: Path) -> Path:
    return path.with_name(f"{path.name}.marks")


class LogMarks:
    """Notes where the log of `path` stood when, while it grows (see the module's docstring).
    `note` is called by the shard's watch, often; it writes at most once a second."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._size = -1
        self._at = -math.inf

    def note(self, now: float) -> None:
        """Mark the log's size at wall time `now`, if it grew and a second has passed."""
        if now - self._at < MARK_EVERY_S:
            return
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size == self._size:
            return
        self._size, self._at = size, now
        marks = marks_of(self.path)
        try:
            fd = os.open(marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE)
            with os.fdopen(fd, "a") as f:
                f.write(f"{now:.3f} {size}\n")
            if marks.stat().st_size > MAX_MARKS_BYTES:
                _cut(marks, MAX_MARKS_BYTES // 2)
        except OSError:
            return  # a full disk: --since reads from further back meanwhile

    def restart(self) -> None:
        """The log was moved aside (a new run begins): the next note marks again."""
        self._size = -1
        self._at = -math.inf


def rotate(path: Path, keep: int = KEEP_RUNS) -> None:
    """Move `path` (the run before's log) to `path.1`, `.1` to `.2`, ..., dropping what is
    past `keep`, each run's marks with it; the run moved aside keeps its last
    MAX_RUN_BYTES."""
    if not path.exists() or path.stat().st_size == 0:
        marks_of(path).unlink(missing_ok=True)
        return
    for k in range(keep, 0, -1):
        older, newer = (_run(path, k - 1) if k > 1 else path), _run(path, k)
        if older.exists():
            os.replace(older, newer)
        if marks_of(older).exists():
            os.replace(marks_of(older), marks_of(newer))
        else:
            marks_of(newer).unlink(missing_ok=True)  # a run with no marks takes no other's
    dropped = _cut(_run(path, 1), MAX_RUN_BYTES)
    if dropped:
        _shift_marks(marks_of(_run(path, 1)), dropped)


def run_of(f: BinaryIO) -> str:
    """Which run an open log is: its file's identity, kept when it is moved aside."""
    st = os.fstat(f.fileno())
    return f"{st.st_dev}:{st.st_ino}"


def read_log(path: Path, request: LogRequest, now: float) -> LogAnswer:
    """The part of the log of `path` (or of a run before it) that `request` asks for; `now`
    is the wall clock, for `since_s`.

    A follow (`offset`) follows the shard, not one file: when its engine started again
    since the run the offset is in (`run`), the rest of that run (moved aside) comes first,
    then the new run from its start; a log cut shorter than the offset is read from its
    start."""
    target = path if request.previous == 0 else _run(path, request.previous)
    try:
        with target.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            run = run_of(f)
            if request.offset is None:
                start = max(0, end - MAX_ANSWER_BYTES)
                if request.since_s is not None:
                    start = max(start, _offset_at(marks_of(target), now - request.since_s))
                f.seek(min(start, end))
                text = f.read().decode(errors="replace")
                return LogAnswer(
                    id=request.id,
                    lines=list(deque(text.splitlines(), maxlen=request.tail)),
                    offset=end,
                    run=run,
                )
            lines: list[str] = []
            start = request.offset
            if request.run is not None and request.run != run:
                lines = _rest_of_run(path, request.run, request.offset)
                start = 0
            elif start > end:
                start = 0  # cut (or a follow begun before runs were named, and a restart)
            read, offset = _read_whole_lines(f, start)
            return LogAnswer(id=request.id, lines=lines + read, offset=offset, run=run)
    except FileNotFoundError:
        run = "its current run" if request.previous == 0 else f"run -{request.previous}"
        return LogAnswer(id=request.id, error=f"no log of {run} on this node")
    except OSError as exc:
        return LogAnswer(id=request.id, error=f"cannot read {target.name}: {exc}")


def _read_whole_lines(f: BinaryIO, start: int) -> tuple[list[str], int]:
    """The lines of `f` from `start` on (at most MAX_ANSWER_BYTES: then only whole lines,
    the rest comes with the next follow), and where they end."""
    f.seek(start)
    data = f.read(MAX_ANSWER_BYTES)
    whole = data[: data.rfind(b"\n") + 1] if len(data) == MAX_ANSWER_BYTES else data
    return whole.decode(errors="replace").splitlines(), start + len(whole)


def _rest_of_run(path: Path, run: str, offset: int) -> list[str]:
    """What the run `run` of `path`'s shard wrote from `offset` on, now that it was moved
    aside (the engine started again); nothing when it is gone (past KEEP_RUNS)."""
    for k in range(1, KEEP_RUNS + 1):
        try:
            with _run(path, k).open("rb") as f:
                if run_of(f) == run:
                    return _read_whole_lines(f, offset)[0]
        except OSError:
            continue
    return []


def _run(path: Path, k: int) -> Path:
    return path.with_name(f"{path.name}.{k}")


def _offset_at(marks: Path, when: float) -> int:
    """Where the log stood at its last mark at or before `when`: what was written after it
    came at `when` or later (or up to a mark's interval before). 0 when no mark is that old."""
    offset = 0
    try:
        text = marks.read_text(errors="replace")
    except OSError:
        return 0
    for line in text.splitlines():
        at, _, size = line.partition(" ")
        try:
            if float(at) > when:
                break
            offset = int(size)
        except ValueError:
            continue  # the partial line a cut left
    return offset


def _shift_marks(marks: Path, dropped: int) -> None:
    """The log's first `dropped` bytes were cut away: its marks move back as much."""
    try:
        lines = marks.read_text(errors="replace").splitlines()
    except OSError:
        return
    kept = []
    for line in lines:
        at, _, size = line.partition(" ")
        try:
            kept.append(f"{at} {max(0, int(size) - dropped)}")
        except ValueError:
            continue
    marks.write_text("".join(f"{k}\n" for k in kept))


def _cut(path: Path, keep: int) -> int:
    """Keep the last `keep` bytes of `path`; returns how many went."""
    size = path.stat().st_size
    if size <= keep:
        return 0
    with path.open("rb") as f:
        f.seek(size - keep)
        tail = f.read()
    with path.open("wb") as f:
        f.write(tail)
    return size - keep


# What marks a line as an engine's error: a Python exception's last line, argparse's
# "prog: error: ...", a log record at ERROR or above (vLLM and SGLang write "ERROR 12-06
# 17:29:18 [file.py:12] ..."; llama.cpp "error: ..." or "E ...").
_ERROR_LINE = re.compile(
    r"^(?:[\w.]+(?:Error|Exception|Exit)\b.*|.*\berror: .+|(?:ERROR|CRITICAL|FATAL)\b.+)$"
)
# What goes before an engine's own words: vLLM's process tag; a level, date, time and source.
_PROCESS_TAG = re.compile(r"^\(\w+ pid=\d+\)\s*")
_LEVEL_PREFIX = re.compile(r"^(?:ERROR|CRITICAL|FATAL)\s+[\d-]+\s+[\d:.]+\s+\[[^\]]*\]\s*")


def last_error_line(lines: list[str], limit: int = 500) -> str | None:
    """The last line of `lines` (an engine's log tail) that says what went wrong, without
    its log prefix; for a pydantic validation error, with the reasons listed under it. None
    when no line looks like an error (a process killed with -9 says nothing)."""
    for index in range(len(lines) - 1, -1, -1):
        line = _PROCESS_TAG.sub("", lines[index].strip())
        if not _ERROR_LINE.match(line) or line.startswith("Traceback"):
            continue
        line = _LEVEL_PREFIX.sub("", line)
        if "validation error" in line:
            detail = [
                d.strip()
                for d in lines[index + 1 : index + 6]
                if d.strip() and not d.strip().startswith("For further information")
            ]
            line = " ".join([line, *detail])
        return line[:limit]
    return None
