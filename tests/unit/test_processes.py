"""Ports for listeners are picked where outgoing connections do not take them; private temp
folders are swept once their owner is gone."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from modelfleet.host.files import owned_temp_dir, sweep_owned
from modelfleet.host.processes import ProcessId, _ephemeral_low, free_port


def test_a_free_port_is_below_the_range_of_outgoing_connections_and_bindable() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_services_and_engines_pick_ports_in_bands_of_their_own() -> None:
    """`up` picks its services' ports before they bind them and agents pick their engines'
    meanwhile: no engine may take a port promised to a service."""
    low = _ephemeral_low()
    services = {free_port("127.0.0.1", "services") for _ in range(200)}
    engines = {free_port("127.0.0.1", "engines") for _ in range(200)}
    anywhere = {free_port("127.0.0.1") for _ in range(200)}
    assert max(engines) < min(services) and max(services) < low
    assert min(anywhere) < min(services) and max(anywhere) > max(engines)


def test_a_private_temp_folder_is_swept_once_its_owner_is_gone(tmp_path: Path) -> None:
    """`owned_temp_dir` names a folder with its owner's pid and start time; the next one made
    with that prefix removes those whose owner no longer runs: a pid now another process's
    (another start time) counts as gone, a running owner's folder stays, and so does what is
    not named so."""
    mine = owned_temp_dir("mf-test-", tmp_path)
    assert mine.stat().st_mode & 0o777 == 0o700
    me = ProcessId.of(os.getpid())
    assert me is not None and mine.name.startswith(f"mf-test-{me.pid}-{me.started:.2f}-")
    reused = tmp_path / f"mf-test-{me.pid}-{me.started - 5:.2f}-00ff"  # the pid, reused
    with subprocess.Popen(["true"]) as gone:
        pass
    dead = tmp_path / f"mf-test-{gone.pid}-{me.started:.2f}-abcd"
    other = tmp_path / "mf-test-made-by-hand"
    for folder in (reused, dead, other):
        folder.mkdir()
        (folder / "worker-0.yaml").write_text("push_token: secret\n")
    again = owned_temp_dir("mf-test-", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, again.name, other.name])
    assert sweep_owned("mf-test-", tmp_path) == []
