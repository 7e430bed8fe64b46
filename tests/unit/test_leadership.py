"""The lease as one control plane sees it, on a real SQLite store shared with another, by an
injected monotonic clock: it acts only while it may, and when another took the lease it
stops and records LeadershipLost (a write its fence would otherwise refuse)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.leadership import (
    ACT_SHARE,
    AFTER_EXPIRY_S,
    SOONEST_S,
    Leadership,
    Process,
    Turn,
    holder_name,
    this_process,
)
from modelfleet.store import Fenced
from modelfleet.store.sqlite import SqliteStore


def test_a_leader_whose_lease_was_taken_stops_acting_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    mine, theirs = SqliteStore(path), SqliteStore(path)
    clock = [100.0]
    ttl = 0.3
    events = EventLog(mine, time.time, source="a")
    a = Leadership(mine, "cp-a", ttl, lambda: clock[0], events)
    assert a.renew_now() is Turn.ELECTED and a.acting() and a.leading_epoch == 1
    clock[0] += ACT_SHARE * ttl  # no renewal since: it stops acting before the lease runs out
    assert not a.acting()
    deadline = time.monotonic() + 5
    while theirs.lease().remaining_s > 0:  # the lease runs out by the store's clock
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.02)
    b = Leadership(theirs, "cp-b", ttl, time.monotonic)
    assert b.renew_now() is Turn.ELECTED and b.leading_epoch == 2
    assert a.renew_now() is Turn.LOST and a.leading_epoch is None and a.leader == "cp-b"
    events.flush()  # written by the log's own writer in a control plane
    lost = [e for e in theirs.events() if e.reason == "LeadershipLost"]
    assert [(e.regarding, e.message, e.source) for e in lost] == [
        ("control-plane/cp-a", "cp-b leads now, epoch 2", "a")
    ]
    with pytest.raises(Fenced):  # anything else it still had under way stays fenced
        mine.set_meta("late", "write")


def test_two_state_dirs_at_one_path_on_one_host_never_share_a_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cloned machines: one host name, the default state dir path, each its own folder. The
    path they show is made the same here; each folder's instance id still tells them apart,
    and a restart on the same folder keeps its name (it takes its own lease back)."""
    first, second = tmp_path / "host-a", tmp_path / "host-b"
    with monkeypatch.context() as patched:
        patched.setattr("socket.gethostname", lambda: "gpu-cp")
        patched.setattr("os.path.abspath", lambda _: "/var/lib/modelfleet")
        a_name, b_name, a_again = holder_name(first), holder_name(second), holder_name(first)
    assert a_name != b_name and a_name.startswith("gpu-cp:/var/lib/modelfleet:")
    assert a_again == a_name  # the same folder again: the same name
    path = tmp_path / "store.sqlite"
    a = Leadership(SqliteStore(path), a_name, 30.0, time.monotonic)
    b = Leadership(SqliteStore(path), b_name, 30.0, time.monotonic)
    assert a.renew_now() is Turn.ELECTED and a.leading_epoch == 1
    assert b.renew_now() is Turn.FOLLOWING and b.leading_epoch is None and b.leader == a_name
    again = Leadership(SqliteStore(path), a_again, 30.0, time.monotonic)
    assert again.renew_now() is Turn.ELECTED and again.leading_epoch == 1  # its own, at once


def test_a_follower_tries_to_take_the_lease_just_after_it_runs_out(tmp_path: Path) -> None:
    """Tried only every third of the TTL, a lease killed with its leader was taken up to a
    third of a TTL after it ran out (kill -9 of the leader to another's first pass: 3.0-4.2 s
    at the default 3 s). A follower now tries just after the lease it read runs out."""
    path = tmp_path / "store.sqlite"
    ttl = 3.0
    clock = [100.0]
    a = Leadership(SqliteStore(path), "cp-a", ttl, time.monotonic)
    b = Leadership(SqliteStore(path), "cp-b", ttl, lambda: clock[0])
    assert a.renew_now() is Turn.ELECTED
    assert a.next_try_in() == pytest.approx(ttl / 3)  # a leader renews every third of the TTL
    assert b.renew_now() is Turn.FOLLOWING
    left = SqliteStore(path).lease().remaining_s
    assert ttl - 0.5 < left <= ttl
    assert b.next_try_in() == pytest.approx(ttl / 3)  # the lease ends later than that
    clock[0] += left - 0.5
    assert b.next_try_in() == pytest.approx(0.5 + AFTER_EXPIRY_S, abs=0.05)
    clock[0] += 1.0  # past its end (this clock is the follower's alone): tried again soon
    assert b.next_try_in() == SOONEST_S
    b.problem = "the store did not answer"  # what it read may be stale: the usual pace
    assert b.next_try_in() == pytest.approx(ttl / 3)


def test_a_leader_whose_renewal_came_late_says_so_and_names_no_other_leader(
    tmp_path: Path,
) -> None:
    """At 10,000 nodes on a starved machine a lone control plane's renewal came late; agents
    and operators were told "this control plane follows; the leader is <itself>, not
    reachable yet". `lapsed` says what holds: its own lease, not yet renewed."""
    clock = [100.0]
    a = Leadership(SqliteStore(tmp_path / "store.sqlite"), "cp-a", 30.0, lambda: clock[0])
    assert a.lapsed() is None  # nothing read yet
    assert a.renew_now() is Turn.ELECTED and a.lapsed() is None
    clock[0] += ACT_SHARE * 30.0
    assert not a.acting() and a.leader == "cp-a"
    said = a.lapsed()
    assert said is not None and "holds the lease but may not act until it renews it" in said
    assert a.renew_now() is Turn.LEADING and a.lapsed() is None  # renewed: acts again
    b = Leadership(SqliteStore(tmp_path / "store.sqlite"), "cp-b", 30.0, lambda: clock[0])
    assert b.renew_now() is Turn.FOLLOWING and b.lapsed() is None  # another's lease: follows


def test_a_leader_elected_again_after_others_led_says_so_not_that_it_is_the_first(
    tmp_path: Path,
) -> None:
    """Issue 57: a leader frozen past its lease, taken meanwhile by another whose lease ran
    out too, was elected again as "the first to lead on this store"."""
    path = tmp_path / "store.sqlite"
    mine, theirs = SqliteStore(path), SqliteStore(path)
    ttl = 0.2
    events = EventLog(mine, time.time, source="a")
    a = Leadership(mine, "cp-a", ttl, time.monotonic, events)
    assert a.renew_now() is Turn.ELECTED and a.leading_epoch == 1

    def ran_out() -> None:
        deadline = time.monotonic() + 5
        while theirs.lease().remaining_s > 0:  # by the store's clock
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.02)

    ran_out()  # a is frozen: no renewal
    b = Leadership(theirs, "cp-b", ttl, time.monotonic)
    assert b.renew_now() is Turn.ELECTED and b.leading_epoch == 2
    ran_out()  # b is gone
    assert a.renew_now() is Turn.ELECTED and a.leading_epoch == 3
    events.flush()
    elected = [e.message for e in mine.events("control-plane") if e.reason == "LeaderElected"]
    assert elected == [
        "leads under epoch 1: the first to lead on this store",
        "leads under epoch 3: its lease of epoch 1 ran out before it renewed it (frozen, or "
        "cut off from the store); 1 other term(s) since",
    ]


def test_a_leader_acts_for_its_share_of_the_ttl_from_when_it_asked_not_from_the_answer(
    tmp_path: Path,
) -> None:
    """M03: the lease runs out `ttl` after the store renewed it, which is at most when the
    leader asked; a slow answer must not lengthen what the leader believes it holds."""
    clock = [100.0]
    ttl, slow = 3.0, 1.0

    class SlowStore:
        """The store, answering a renewal `slow` seconds after it was asked."""

        def __init__(self, store: SqliteStore) -> None:
            self.store = store

        def take_lease(self, *args: Any, **kwargs: Any) -> Any:
            lease = self.store.take_lease(*args, **kwargs)
            clock[0] += slow
            return lease

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

    store: Any = SlowStore(SqliteStore(tmp_path / "store.sqlite"))
    a = Leadership(store, "cp-a", ttl, lambda: clock[0])
    assert a.renew_now() is Turn.ELECTED  # asked at 100, answered at 101
    clock[0] = 100.0 + ACT_SHARE * ttl - 0.01
    assert a.acting()
    clock[0] = 100.0 + ACT_SHARE * ttl + 0.01  # from the answer it would still act
    assert not a.acting()


def _exited_pid() -> int:
    probe = subprocess.Popen([sys.executable, "-c", "pass"])
    probe.wait()
    return probe.pid


def test_a_copied_state_dir_never_leads_beside_the_live_process_that_holds_its_name(
    tmp_path: Path,
) -> None:
    """Issue 57: two processes with one holder name (a copied state dir, a cloned machine)
    both led under epoch 1. The second now refuses while the first lives, says why (and in
    an event), and says nothing of where it is reached under that name."""
    path = tmp_path / "store.sqlite"
    me = this_process()
    other = Process(me.host, 1, me.boot)  # init: alive as long as this machine is
    events = EventLog(SqliteStore(path), time.time, source="b")
    a = Leadership(SqliteStore(path), "cp:/state:abc", 30.0, time.monotonic, process=other)
    b = Leadership(SqliteStore(path), "cp:/state:abc", 30.0, time.monotonic, events, me)
    assert a.renew_now() is Turn.ELECTED and a.leading_epoch == 1
    assert b.renew_now() is Turn.FOLLOWING and not b.acting() and b.leading_epoch is None
    assert "held in the lease by another live process (pid 1 on" in b.refused, b.refused
    assert a.renew_now() is Turn.LEADING and a.acting()
    events.flush()
    refused = [e for e in SqliteStore(path).events() if e.reason == "LeadershipRefused"]
    assert [e.message for e in refused] == [b.refused]
    far = Process("another-host", me.pid, "x")  # another host: whether it lives is unknown
    c = Leadership(SqliteStore(path), "cp:/state:abc", 30.0, time.monotonic, process=far)
    assert c.renew_now() is Turn.FOLLOWING and c.refused


def test_a_restart_takes_its_own_lease_back_at_once_and_a_clone_only_once_it_ran_out(
    tmp_path: Path,
) -> None:
    """The process under the lease's name exited (this host, this boot, its pid gone): a
    restart, which takes the lease back at once under the same epoch. One whose process may
    live takes it only once it ran out, under the next epoch, and the other, back, finds it
    lost and refuses."""
    path = tmp_path / "store.sqlite"
    me = this_process()
    gone = Process(me.host, _exited_pid(), me.boot)
    before = Leadership(SqliteStore(path), "cp:/s:1", 30.0, time.monotonic, process=gone)
    assert before.renew_now() is Turn.ELECTED and before.leading_epoch == 1
    again = Leadership(SqliteStore(path), "cp:/s:1", 0.3, time.monotonic, process=me)
    assert again.renew_now() is Turn.ELECTED and again.leading_epoch == 1 and not again.refused
    clone = Leadership(SqliteStore(path), "cp:/s:1", 0.3, time.monotonic,
                       process=Process("clone", 7, "b"))  # fmt: skip
    assert clone.renew_now() is Turn.FOLLOWING and clone.refused
    deadline = time.monotonic() + 5
    while SqliteStore(path).lease().remaining_s > 0:  # `again` frozen: its lease runs out
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.02)
    assert clone.renew_now() is Turn.ELECTED and clone.leading_epoch == 2 and not clone.refused
    assert again.renew_now() is Turn.LOST and not again.acting() and again.refused
