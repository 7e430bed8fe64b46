"""`AssignmentWatch`: where the agent API holds heartbeats until their node's assignment may
have changed (a long poll), so an assignment reaches its agent as soon as it is made while an
idle node costs one request per heartbeat interval."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class AssignmentWatch:
    """Heartbeats waiting, by node. A waiter is a future and a timer, not a task: ten thousand
    held heartbeats cost their futures, nothing per wake-up of the event loop."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[asyncio.Future[bool]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def waiting(self) -> int:
        """How many heartbeats are held now."""
        return sum(len(w) for w in self._waiting.values())

    async def wait(self, node: str, timeout: float) -> bool:
        """Wait until `node`'s assignment may have changed (True), or `timeout` seconds have
        passed or the watch was closed (False)."""
        if self._closed:
            return False
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        waiting = self._waiting.setdefault(node, [])
        waiting.append(future)
        timer = loop.call_later(timeout, _settle, future, False)
        try:
            return await future
        finally:
            timer.cancel()
            if future in waiting:
                waiting.remove(future)
            if not waiting and self._waiting.get(node) is waiting:
                del self._waiting[node]

    def notify(self, nodes: Iterable[str]) -> None:
        """Wake the heartbeats held for `nodes`: their assignments may have changed."""
        for node in nodes:
            for future in self._waiting.get(node, ()):
                _settle(future, True)

    def close(self) -> None:
        """Answer every held heartbeat now, and hold none from now on: a control plane that
        stops answers them before its listeners finish their requests."""
        self._closed = True
        for waiting in self._waiting.values():
            for future in waiting:
                _settle(future, False)

    async def run(self) -> None:
        """Run as one of the service's loops, it closes the watch when cancelled: the service
        cancels its loops before it stops its listeners."""
        try:
            await asyncio.Event().wait()
        finally:
            self.close()


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
