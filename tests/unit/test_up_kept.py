"""What `modelfleet up` keeps across restarts on one state dir: made once, the same after."""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path

import pytest

from modelfleet.up.kept import KEPT_FILE, KeptError, load_or_make


def test_the_first_up_makes_credentials_and_ports_and_later_ones_get_the_same(
    tmp_path: Path,
) -> None:
    first = load_or_make(tmp_path)
    assert first.notes == []
    assert stat.S_IMODE((tmp_path / KEPT_FILE).stat().st_mode) == 0o600
    assert first.kept.api_key.startswith("mf-")
    assert len({first.kept.router_port, first.kept.push_port, first.kept.agent_port}) == 3
    again = load_or_make(tmp_path)
    assert again.kept == first.kept and again.notes == []
    assert load_or_make(tmp_path / "elsewhere").kept.api_key != first.kept.api_key


def test_a_kept_port_taken_since_moves_and_says_so(tmp_path: Path) -> None:
    first = load_or_make(tmp_path).kept
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first.push_port))
        holder.listen()
        moved = load_or_make(tmp_path)
    assert moved.kept.push_port != first.push_port
    assert moved.kept.api_key == first.api_key and moved.kept.router_port == first.router_port
    assert moved.notes == [f"push port {first.push_port} is taken now; using "
                           f"{moved.kept.push_port} instead"]  # fmt: skip
    assert load_or_make(tmp_path).kept.push_port == moved.kept.push_port  # and it stays moved


def test_a_router_port_asked_for_is_kept_from_then_on(tmp_path: Path) -> None:
    first = load_or_make(tmp_path).kept
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        wanted = probe.getsockname()[1]
    assert load_or_make(tmp_path, router_port=wanted).kept.router_port == wanted
    after = load_or_make(tmp_path).kept
    assert after.router_port == wanted and after.admin_token == first.admin_token


def test_an_unreadable_kept_file_stops_up_and_is_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / KEPT_FILE
    path.write_text('{"api_key": "mf-x"}')
    with pytest.raises(KeptError, match=f"cannot read {path}.*delete it to make new ones"):
        load_or_make(tmp_path)
    assert path.read_text() == '{"api_key": "mf-x"}'


def test_the_redis_up_runs_has_a_password_kept_as_long_as_it_is_run(tmp_path: Path) -> None:
    """`--redis` gives that Redis a password, in the router's URL; later `up`s keep it (the
    Redis and router left running are adopted with it), a kept file from before passwords gets
    one, and `--limits-store` (no Redis run) drops it."""
    first = load_or_make(tmp_path, redis=True).kept
    assert first.redis_password and len(first.redis_password) >= 24
    assert first.limits_url == f"redis://:{first.redis_password}@127.0.0.1:{first.redis_port}/0"
    assert load_or_make(tmp_path).kept.redis_password == first.redis_password
    kept = tmp_path / KEPT_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    older = json.loads(kept.read_text())
    del older["redis_password"]
    kept.write_text(json.dumps(older))
    given = load_or_make(tmp_path).kept
    assert given.redis_password and given.redis_password != first.redis_password
    assert given.redis_port == first.redis_port
    own = load_or_make(tmp_path, limits_store="redis://cache:6379/0").kept
    assert own.redis_password is None and own.limits_url == "redis://cache:6379/0"
