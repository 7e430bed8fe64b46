"""Engines' logs on demand: the agent's files and runs kept (`agent/logs.py`), and the
control plane's relay of requests through the agents' heartbeats (`controlplane/logs.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from modelfleet.agent.logs import KEEP_RUNS, read_log, rotate, shard_log
from modelfleet.controlplane.logs import RESEND_AFTER_S, LogRelay, LogUnanswered
from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.wire import LogAnswer, LogRequest


def ask(previous: int = 0, tail: int = 200, offset: int | None = None) -> LogRequest:
    return LogRequest(id="r", replica_id="m-1", rank=0, previous=previous, tail=tail,
                      offset=offset)  # fmt: skip


def test_each_start_keeps_the_runs_before_and_a_follow_reads_what_came_since(
    tmp_path: Path,
) -> None:
    path = shard_log(tmp_path, "m-1", 0)
    for run in range(KEEP_RUNS + 2):  # seven runs: the current and the five before are kept
        rotate(path)
        path.write_text("".join(f"run {run} line {i}\n" for i in range(3)))
    assert read_log(path, ask(tail=2)).lines == ["run 6 line 1", "run 6 line 2"]
    assert read_log(path, ask(previous=1, tail=1)).lines == ["run 5 line 2"]
    assert read_log(path, ask(previous=KEEP_RUNS, tail=1)).lines == ["run 1 line 2"]
    gone = read_log(path, ask(previous=KEEP_RUNS + 1))
    assert gone.error == f"no log of run -{KEEP_RUNS + 1} on this node" and gone.lines == []
    first = read_log(path, ask(tail=1))
    with path.open("a") as out:
        out.write("more\n")
    followed = read_log(path, ask(offset=first.offset))
    assert followed.lines == ["more"] and followed.offset == path.stat().st_size
    assert read_log(path, ask(offset=followed.offset)).lines == []


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
