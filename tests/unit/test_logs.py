"""Engines' logs on demand: the agent's files and runs kept (`agent/logs.py`), and the
control plane's relay of requests through the agents' heartbeats (`controlplane/logs.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from modelfleet.agent import logs
from modelfleet.agent.logs import (
    KEEP_RUNS,
    LogMarks,
    last_error_line,
    marks_of,
    read_log,
    rotate,
    shard_log,
)
from modelfleet.controlplane.logs import RESEND_AFTER_S, LogRelay, LogUnanswered
from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.messages.wire import LogAnswer, LogRequest

NOW = 1_800_000_000.0


def ask(
    previous: int = 0, tail: int = 200, offset: int | None = None, since_s: float | None = None
) -> LogRequest:
    return LogRequest(id="r", replica_id="m-1", rank=0, previous=previous, tail=tail,
                      offset=offset, since_s=since_s)  # fmt: skip


def test_each_start_keeps_the_runs_before_and_a_follow_reads_what_came_since(
    tmp_path: Path,
) -> None:
    path = shard_log(tmp_path, "m-1", 0)
    for run in range(KEEP_RUNS + 2):  # seven runs: the current and the five before are kept
        rotate(path)
        path.write_text("".join(f"run {run} line {i}\n" for i in range(3)))
    assert read_log(path, ask(tail=2), NOW).lines == ["run 6 line 1", "run 6 line 2"]
    assert read_log(path, ask(previous=1, tail=1), NOW).lines == ["run 5 line 2"]
    assert read_log(path, ask(previous=KEEP_RUNS, tail=1), NOW).lines == ["run 1 line 2"]
    gone = read_log(path, ask(previous=KEEP_RUNS + 1), NOW)
    assert gone.error == f"no log of run -{KEEP_RUNS + 1} on this node" and gone.lines == []
    first = read_log(path, ask(tail=1), NOW)
    with path.open("a") as out:
        out.write("more\n")
    followed = read_log(path, ask(offset=first.offset), NOW)
    assert followed.lines == ["more"] and followed.offset == path.stat().st_size
    assert read_log(path, ask(offset=followed.offset), NOW).lines == []


def test_a_request_is_handed_to_its_node_again_until_answered() -> None:
    now = [100.0]
    relay = LogRelay(AssignmentWatch(), clock=lambda: now[0])

    async def go() -> LogAnswer:
        asked = asyncio.ensure_future(relay.ask("n1", "m-1", 0, 0, 10, None, timeout=5))
        await asyncio.sleep(0)
        assert relay.pending("n1") and not relay.pending("n2")
        [first] = relay.take("n1")
        assert relay.take("n1") == [] and not relay.pending("n1")  # handed over just now
        now[0] += RESEND_AFTER_S  # that answer was lost: handed over again
        assert relay.pending("n1") and [r.id for r in relay.take("n1")] == [first.id]
        assert not relay.answered("n2", LogAnswer(id=first.id, lines=["x"]))  # not its
        assert relay.answered("n1", LogAnswer(id=first.id, lines=["hello"]))
        return await asked

    assert asyncio.run(go()).lines == ["hello"]


def test_an_agent_that_does_not_answer_times_the_request_out() -> None:
    relay = LogRelay(AssignmentWatch())

    async def go() -> None:
        with pytest.raises(LogUnanswered, match="the agent of n1 did not answer"):
            await relay.ask("n1", "m-1", 0, 0, 10, None, timeout=0.05)
        assert not relay.pending("n1")  # nothing left behind

    asyncio.run(go())


def test_since_reads_from_where_the_log_stood_then_also_in_runs_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent marks the log's size as it grows (at most once a second); --since starts at
    the last mark at or before then. Marks move with their run, and follow a run's cut."""
    path = shard_log(tmp_path, "m-1", 0)
    marks = LogMarks(path)
    t = NOW - 600  # ten minutes ago
    for minute in range(10):
        with path.open("a") as out:
            out.write(f"minute {minute}\n")
        marks.note(t + minute * 60)
        marks.note(t + minute * 60 + 0.5)  # within the second: not marked again
    assert len(marks_of(path).read_text().splitlines()) == 10
    # The last 3 minutes: written after the mark of 7 minutes ago (minute 3's).
    got = read_log(path, ask(since_s=7 * 60 - 1), NOW)
    assert got.lines == [f"minute {m}" for m in range(4, 10)]
    assert read_log(path, ask(since_s=7 * 60 - 1, tail=2), NOW).lines == ["minute 8", "minute 9"]
    assert read_log(path, ask(since_s=3600), NOW).lines[0] == "minute 0"  # older than any mark
    assert read_log(path, ask(since_s=0), NOW).lines == []  # nothing written since now

    # A restart moves the log and its marks aside together; the new run marks anew.
    monkeypatch.setattr(logs, "MAX_RUN_BYTES", 30)  # the run moved aside keeps its last 30 B
    rotate(path)
    marks.restart()
    assert not marks_of(path).exists() and marks_of(path.with_name(path.name + ".1")).exists()
    path.write_text("new run\n")
    marks.note(NOW)
    before = read_log(path, ask(previous=1, since_s=3 * 60 - 1), NOW)
    assert before.lines == ["minute 8", "minute 9"]  # offsets moved back by what the cut took
    assert read_log(path, ask(since_s=10), NOW).lines == ["new run"]


def test_the_last_error_line_of_an_engine_is_found_without_its_log_prefix() -> None:
    """Lines as vLLM 0.32 wrote them when it refused its arguments or its model."""
    argparse = [
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "usage: vllm serve [model_tag] [options]",
        "vllm serve: error: argument --max-lora-rank: invalid choice: 24 (choose from 1, 8)",
    ]
    assert last_error_line(argparse) == argparse[-1]
    pydantic = [
        "(APIServer pid=7) ERROR 12-06 17:29:18 [core.py:12] EngineCore failed to start.",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (9999) is greater than the derived one",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
        "",
    ]
    assert last_error_line(pydantic) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
        "Value error, User-specified max_model_len (9999) is greater than the derived one"
    )
    assert last_error_line(pydantic[:1]) == "EngineCore failed to start."
    assert last_error_line(["INFO: Started server process [6458]", "Killed"]) is None
    assert last_error_line([]) is None


def test_a_follow_goes_on_across_a_restart_and_a_cut(tmp_path: Path) -> None:
    """A follow asked by offset alone read the new run from the old run's offset: nothing
    until the new run outgrew the old one, then from its middle. With the run it is in, it
    gets the rest of that run, then the new run from its start."""
    path = shard_log(tmp_path, "m-1", 0)
    path.write_text("one: starting\n")
    first = read_log(path, ask(), NOW)
    assert first.lines == ["one: starting"] and first.run
    with path.open("a") as f:
        f.write("one: exited (1)\n")
    rotate(path)  # the engine starts again: its new run's log begins
    path.write_text("two\n")
    follow = LogRequest(id="r", replica_id="m-1", rank=0, offset=first.offset, run=first.run)
    after = read_log(path, follow, NOW)
    assert after.lines == ["one: exited (1)", "two"]
    assert after.run != first.run and after.offset == len("two\n")
    same = read_log(path, follow.model_copy(update={"offset": after.offset, "run": after.run}), NOW)
    assert same.lines == [] and same.run == after.run
    path.write_text("t\n")  # cut shorter than where the follow stood (same file)
    cut = read_log(path, follow.model_copy(update={"offset": after.offset, "run": after.run}), NOW)
    assert cut.lines == ["t"]
