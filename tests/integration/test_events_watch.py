"""`ctl events --watch` against a running fleet: new events as they come, a repeat shown
again as it counts up (a repeat keeps its event's id, so a watch by id alone missed it), and
on across a restart of the control plane (it exited then)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from .conftest import ctl_target, fleet_of, wait_for


def test_a_watch_shows_new_events_and_repeats_counting_up(tmp_path: Path) -> None:
    with fleet_of(tmp_path, [{"name": "m", "engine": "sim"}]) as fleet:
        watch = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "ctl", *ctl_target(fleet),
             "events", "--watch", "--for", "node/node-2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        admin = {"authorization": f"Bearer {fleet.admin_token}"}
        lines: queue.Queue[str] = queue.Queue()
        seen: list[str] = []

        def read() -> None:
            assert watch.stdout is not None
            for line in watch.stdout:
                lines.put(line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()

        def saw(text: str) -> bool:
            while not lines.empty():
                seen.append(lines.get())
            return any(text in line for line in seen)

        try:
            wait_for("the node's first event in the watch", lambda: saw("NodeReported"))
            for _ in range(3):  # the second and third are the same event: it counts up
                done = subprocess.run(
                    [sys.executable, "-m", "modelfleet", "ctl", *ctl_target(fleet),
                     "cordon", "node-2"],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr
            wait_for("the repeat counted up in the watch", lambda: saw("(x2)"))
            [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
            fleet.fleet.restart(cp)

            def heard_again() -> bool:
                nodes = httpx.get(f"{fleet.admin_url}/v1/nodes", headers=admin, timeout=10)
                return "node-2" in {n["name"] for n in nodes.json()["nodes"]}

            # A node mark needs the node heard of: the restarted one waits for its report.
            wait_for("node-2 heard by the restarted control plane", heard_again, 30)
            done = subprocess.run(
                [sys.executable, "-m", "modelfleet", "ctl", *ctl_target(fleet),
                 "uncordon", "node-2"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            wait_for("the uncordon after the restart, in the watch", lambda: saw("marked none"), 30)
            assert watch.poll() is None, "the watch ended with the control plane's restart"
        finally:
            watch.send_signal(signal.SIGINT)
            try:
                watch.wait(timeout=10)
            except subprocess.TimeoutExpired:
                watch.kill()
                watch.wait()
        # The watch shows what it finds at each poll (a second apart): the repeat's first
        # time may fall in the same poll as its second, and is then shown once, counted up.
        marked = [line for line in seen if "NodeMarked" in line]
        assert 3 <= len(marked) <= 4, seen
        assert "marked cordoned (was none)" in marked[0]
        assert "marked cordoned (was cordoned) (x2)" in marked[-2]
        assert all("(was cordoned)" in line for line in marked[1:])
        assert "marked none (was cordoned)" in marked[-1]
