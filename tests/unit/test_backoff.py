"""The one restart backoff, for engines (agent) and for the fleet's own processes (up)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.core.backoff import Backoff
from modelfleet.store.postgres import RECONNECT, ReconnectAttempt

ENGINES = Backoff(base=10, cap=300, reset_after=600)
UP = Backoff(base=1, cap=30, reset_after=30, first_at_once=True)


def test_engine_delays_double_from_the_base_to_the_cap() -> None:
    assert [ENGINES.delay(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]


def test_up_restarts_at_once_the_first_time_then_doubles() -> None:
    assert [UP.delay(n) for n in range(1, 9)] == [0, 1, 2, 4, 8, 16, 30, 30]


def test_a_long_enough_run_starts_the_count_over() -> None:
    assert ENGINES.failures(before=5, ran_for=599.9) == 6
    assert ENGINES.failures(before=5, ran_for=600) == 1
    assert UP.failures(before=3, ran_for=31) == 1


@given(
    base=st.floats(0.1, 100),
    cap=st.floats(0.1, 1000),
    first_at_once=st.booleans(),
    failures=st.integers(1, 60),
)
def test_delays_never_shrink_and_never_pass_the_cap(
    base: float, cap: float, first_at_once: bool, failures: int
) -> None:
    b = Backoff(base=base, cap=cap, reset_after=10, first_at_once=first_at_once)
    assert 0 <= b.delay(failures) <= b.delay(failures + 1) <= max(cap, 0)
    assert (b.delay(1) == 0) == first_at_once


def test_the_store_pool_tries_again_within_a_second_however_long_the_store_was_gone() -> None:
    """Issue 57: PostgreSQL stopped 60 s and started, changes stayed refused 47-53 s more:
    psycopg's pool tried to connect again after 1, 2, 4 ... 32 s. Its tries, by an injected
    clock, come at most a second apart now, so the first after the store's return comes
    within a second of it, and they still give up when psycopg's would."""
    attempt = ReconnectAttempt(timeout=300.0)
    now, tries = 0.0, [0.0]
    while not attempt.time_to_give_up(now):
        attempt.update_delay(now)
        now += attempt.delay
        tries.append(now)
    assert tries[-1] == pytest.approx(300.0)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert max(gaps) == RECONNECT.cap == 1.0 and gaps[0] == 0.25
    back = 60.0
    assert min(t for t in tries if t >= back) - back <= 1.0
