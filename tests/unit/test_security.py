"""Secrets stay secret: credentials compared in constant time, files that hold them private."""

from __future__ import annotations

import ast
import stat
from pathlib import Path

import pytest

from modelfleet.cli import warn_if_open
from modelfleet.host.files import write_atomic, write_json_atomic
from modelfleet.http.web import bearer_matches
from modelfleet.security.apikeys import hash_key, new_key

SRC = Path(__file__).resolve().parents[2] / "src" / "modelfleet"


def _mentions_credential(node: ast.AST) -> bool:
    """An expression that reads an Authorization header or spells a Bearer credential."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            text = sub.value.lower()
            if text == "authorization" or text.startswith("bearer "):
                return True
    return False


def test_no_credential_is_compared_with_equality() -> None:
    """`==` on a token returns sooner the sooner it differs: every check goes through
    `web.bearer_matches` (constant time) or the key ring's hash lookup."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            equality = isinstance(node, ast.Compare) and any(
                isinstance(op, ast.Eq | ast.NotEq) for op in node.ops
            )
            if equality and _mentions_credential(node):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []
    assert len(list(SRC.rglob("*.py"))) > 40  # it did read the sources


def test_bearer_matches_only_the_whole_token() -> None:
    assert bearer_matches("Bearer s3cret-token", "s3cret-token")
    assert not bearer_matches("Bearer s3cret-toke", "s3cret-token")
    assert not bearer_matches("Bearer s3cret-token-and-more", "s3cret-token")
    assert not bearer_matches(None, "s3cret-token")
    assert not bearer_matches("Bearer ", None)


def test_files_that_hold_secrets_are_private_and_whole(tmp_path: Path) -> None:
    path = tmp_path / "state" / "up.json"
    write_json_atomic(path, {"admin_token": "t"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    write_atomic(path, "replaced\n")
    assert path.read_text() == "replaced\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["up.json"]  # no temporary file left


def test_a_listener_opened_beyond_loopback_without_a_credential_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    warn_if_open("127.0.0.1", "the agent API", credential=False)
    warn_if_open("0.0.0.0", "the client API", credential=True)
    assert capsys.readouterr().err == ""
    warn_if_open("0.0.0.0", "the agent API", credential=False)
    assert "warning: the agent API listens on 0.0.0.0 with no credential" in capsys.readouterr().err


def test_api_keys_are_long_random_and_recognisable() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert key.startswith("mf-") and len(key) >= 3 + 22  # 128 bits in base64 or more
    assert hash_key("mf-a") != hash_key("mf-b") and len(hash_key("mf-a")) == 64
