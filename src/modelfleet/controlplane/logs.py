"""Engines' logs on demand (`ctl logs`): asked of the agent of the node that runs the shard,
through the heartbeat it holds.

The admin API asks (`ask`); the node's held heartbeat is answered at once with the request
(`take`); the agent reads its log file and posts what it read to the agent API (`answered`),
which the asking request was waiting for. No connection to the agent is needed: it works for
a node anywhere the agent reaches the control plane from.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable

from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.messages.wire import LogAnswer, LogRequest

RESEND_AFTER_S = 3.0


class LogUnanswered(Exception):
    """The agent did not answer in time (it is silent, or busy reporting)."""


class LogRelay:
    """The log requests waiting for their node's agent, and the answers awaited."""

    def __init__(self, watch: AssignmentWatch, clock: Callable[[], float] = time.monotonic) -> None:
        self.watch = watch
        self.clock = clock
        # node -> its requests not yet answered, each with when it was last handed over
        self._asked: dict[str, list[tuple[LogRequest, float]]] = {}
        self._waiting: dict[str, tuple[str, asyncio.Future[LogAnswer]]] = {}  # id -> node, answer

    def pending(self, node: str) -> bool:
        """Whether a request waits to be handed to `node`'s agent."""
        due = self.clock() - RESEND_AFTER_S
        return any(handed <= due for _, handed in self._asked.get(node, ()))

    def take(self, node: str) -> list[LogRequest]:
        """The requests for `node`'s agent, handed over with the answer to its report or
        heartbeat. An answer can be lost (an agent gives up a held heartbeat when it has
        something to report): what is not answered is handed over again RESEND_AFTER_S
        later."""
        now = self.clock()
        asked = self._asked.get(node, [])
        taken = [request for request, handed in asked if handed <= now - RESEND_AFTER_S]
        self._asked[node] = [
            (r, now if handed <= now - RESEND_AFTER_S else handed) for r, handed in asked
        ]
        return taken

    async def ask(
        self,
        node: str,
        replica_id: str,
        rank: int,
        previous: int,
        tail: int,
        offset: int | None,
        timeout: float,
        since_s: float | None = None,
        run: str | None = None,
    ) -> LogAnswer:
        """What the agent of `node` reads of the log (a follow: from `offset` in `run`, across
        the engine's restarts); LogUnanswered after `timeout` s."""
        request = LogRequest(
            id=secrets.token_hex(8),
            replica_id=replica_id,
            rank=rank,
            previous=previous,
            tail=tail,
            offset=offset,
            since_s=since_s,
            run=run,
        )
        answer: asyncio.Future[LogAnswer] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = (node, answer)
        self._asked.setdefault(node, []).append((request, -math.inf))
        self.watch.notify([node])
        try:
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise LogUnanswered(
                f"the agent of {node} did not answer within {timeout:.0f}s"
            ) from None
        finally:
            self._waiting.pop(request.id, None)
            left = [(r, h) for r, h in self._asked.get(node, ()) if r.id != request.id]
            if left:
                self._asked[node] = left
            else:
                self._asked.pop(node, None)

    def answered(self, node: str, answer: LogAnswer) -> bool:
        """An agent's answer; False when nobody waits for it (or it is not that node's)."""
        waiting = self._waiting.get(answer.id)
        if waiting is None or waiting[0] != node or waiting[1].done():
            return False
        waiting[1].set_result(answer)
        return True
