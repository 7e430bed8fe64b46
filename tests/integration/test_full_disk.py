"""A control plane whose disk fills up keeps serving, refuses changes with the reason, keeps
usage waiting at the routers, and recovers by itself when space returns: a real full disk, a
small tmpfs mounted under its state dir (the test runs as root, as CI does), removed after."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from .conftest import Operator, fleet_of, wait_for

MODEL = {"name": "sim-chat", "engine": "sim", "replicas": 1}


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted on `folder` (made 0700), unmounted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)],
                   check=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path) -> Path:
    """Write to `folder` until its disk is full; returns the file that fills it."""
    filler = folder / "filler"
    # Unbuffered: a buffered file keeps what did not fit and raises ENOSPC again on close.
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_disk_stops_no_service_and_heals_when_space_returns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with (
        small_disk(state / "control-plane", "8m") as cp_dir,
        fleet_of(tmp_path, [MODEL], control_plane={"usage_interval": 0.5}) as fleet,
    ):
        op = Operator(fleet, tmp_path)
        wait_for("sim-chat to serve", lambda: op.serves("sim-chat"), timeout=60)
        control_plane = fleet.fleet.pids()["control-plane"]
        filler = fill(cp_dir)

        # Changes are refused with the reason, and change nothing.
        refused = op.ctl("keys", "create", "alice", check=False)
        assert refused.returncode != 0 and "disk is full" in refused.stderr, refused.stderr
        assert op.get("/v1/keys")["keys"] == []
        marked = op.admin.post("/v1/nodes/node-1/mark", json={"mark": "cordoned"})
        assert marked.status_code == 503 and "nothing was changed" in marked.json()["error"]
        # Usage counted meanwhile waits at the router: the collector cannot store it.
        for _ in range(5):
            assert op.serves("sim-chat")
        status = wait_for(
            "status to say the store cannot write",
            lambda: (s := op.get("/v1/status"))["store_problem"] and s,
        )
        assert "database or disk is full" in status["store_problem"]
        printed = op.ctl("status").stdout
        assert "cannot write" in printed
        # Everything else goes on: reads, the data path, and the process itself.
        assert op.get("/v1/nodes")["nodes"] and op.serves("sim-chat")
        assert fleet.fleet.pids()["control-plane"] == control_plane
        assert os.kill(control_plane, 0) is None

        filler.unlink()  # space returns: it heals by itself
        wait_for("the store to write again", lambda: op.get("/v1/status")["store_problem"] == "")
        used = wait_for(
            "the usage kept by the router to be stored",
            lambda: sum(u["requests"] for u in op.get("/v1/usage")["usage"]) >= 5,
        )
        assert used
        assert op.ctl("keys", "create", "alice").returncode == 0
        assert fleet.fleet.pids()["control-plane"] == control_plane


def test_a_store_that_cannot_be_opened_says_so(tmp_path: Path) -> None:
    """A state dir on a read-only disk: the control plane refuses to start, naming the store
    and why (it once said "cannot read the catalog" while the catalog was fine)."""
    cp_dir = tmp_path / "cp"
    config = tmp_path / "control-plane.yaml"
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("models: []\n")
    config.write_text(
        f"state_dir: {cp_dir}\ncatalog: {catalog}\nagent_port: 0\nadmin_port: 0\n"
        "insecure_agent_api: true\nadmin_token: admin-token-0123456789\n"
    )
    with small_disk(cp_dir, "1m"):
        subprocess.run(["mount", "-o", "remount,ro", str(cp_dir)], check=True)
        done = subprocess.run(
            [sys.executable, "-m", "modelfleet", "control-plane", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert "where the store lives" in done.stderr, done.stderr
    assert str(cp_dir) in done.stderr and "Read-only file system" in done.stderr
    assert "cannot read the catalog" not in done.stderr
