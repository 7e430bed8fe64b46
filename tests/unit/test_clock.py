"""`wait_set`: a bounded wait for an event that never swallows a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from modelfleet.host.clock import wait_set


async def _loop_until_cancelled(
    event: asyncio.Event, wait: Callable[[asyncio.Event], Awaitable[object]]
) -> None:
    """A service loop as the control plane, agent and router run them."""
    while True:
        await wait(event)
        event.clear()


async def _old_wait(event: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), 30)


async def _stopped_as_the_event_is_set(
    wait: Callable[[asyncio.Event], Awaitable[object]],
) -> bool:
    """Whether a loop cancelled in the same turn as its event is set ends (within 2 s)."""
    event = asyncio.Event()
    task = asyncio.create_task(_loop_until_cancelled(event, wait))
    for _ in range(3):  # the loop is in its wait
        await asyncio.sleep(0)
    event.set()
    task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), 2)
    except asyncio.CancelledError:
        return True
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    return False


def test_a_loop_cancelled_as_its_event_is_set_ends() -> None:
    assert asyncio.run(_stopped_as_the_event_is_set(lambda e: wait_set(e, 30)))


def test_a_set_event_is_seen_and_an_unset_one_times_out() -> None:
    async def main() -> tuple[bool, bool, bool]:
        event = asyncio.Event()
        late = asyncio.get_running_loop().call_later(0.01, event.set)
        seen = await wait_set(event, 5)
        late.cancel()
        again = await wait_set(event, 0)  # already set: no wait
        event.clear()
        return seen, again, await wait_set(event, 0.01)

    assert asyncio.run(main()) == (True, True, False)


@pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="Python 3.12 rewrote wait_for on asyncio.timeout"
)
def test_the_wait_for_it_replaces_swallows_that_cancellation() -> None:
    """What `wait_set` is for: on 3.11 the loop on `wait_for` does not end."""
    assert not asyncio.run(_stopped_as_the_event_is_set(_old_wait))


def test_a_set_event_still_lets_the_others_run() -> None:
    async def main() -> bool:
        event, others_ran = asyncio.Event(), False

        async def other() -> None:
            nonlocal others_ran
            others_ran = True

        task = asyncio.create_task(other())
        for _ in range(100):  # a loop whose every pass sets its own event again
            event.set()
            await wait_set(event, 30)
        ran = others_ran
        await task
        return ran

    assert asyncio.run(main())
