"""A service's config file: secrets in it are its owner's alone, or given by file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.host.config import ConfigError, load_config, secrets_in
from modelfleet.router.config import RouterConfig

TOKEN = "admin-token-0123456789"


def written(path: Path, data: object, mode: int) -> Path:
    path.write_text(yaml.safe_dump(data))
    os.chmod(path, mode)
    return path


def test_every_secret_a_config_may_hold_is_found() -> None:
    data = {
        "admin_token": TOKEN,
        "store": "postgresql://modelfleet:pw@db:5432/fleet",
        "routers": [{"url": "https://r:8081", "token": "push-token-0123456789"}],
        "api_keys": [{"name": "a", "key": "mf-abc"}, {"name": "b", "sha256": "00"}],
        "limits_store": "redis://cache:6379/0",  # no password: no secret
        "tls_key": "tls/router.key",  # a path, not a secret
    }
    assert secrets_in(data) == ["admin_token", "store", "routers[0].token", "api_keys[0].key"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_config_holding_a_secret_that_others_may_read_is_refused(
    tmp_path: Path, mode: int
) -> None:
    """Issue 39: the README's commands left control-plane.yaml (admin and push tokens) and
    router.yaml at 0644, with no warning."""
    path = written(tmp_path / "router.yaml", {"push_token": TOKEN}, mode)
    with pytest.raises(ConfigError) as refused:
        load_config(path, RouterConfig)
    said = str(refused.value)
    assert f"{path} holds secrets (push_token)" in said and f"chmod 600 {path}" in said
    assert f"mode {mode:04o}" in said
    os.chmod(path, 0o600)
    assert load_config(path, RouterConfig).push_token == TOKEN
    open_but_harmless = written(tmp_path / "plain.yaml", {"port": 0}, 0o644)
    assert load_config(open_but_harmless, RouterConfig).port == 0


def test_a_token_may_come_from_a_file_of_its_own(tmp_path: Path) -> None:
    secret = tmp_path / "admin-token"
    secret.write_text(TOKEN + "\n")
    os.chmod(secret, 0o600)
    config = written(tmp_path / "cp.yaml", {"admin_token_file": "admin-token"}, 0o644)
    assert load_config(config, ControlPlaneConfig).admin_token == TOKEN
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="holds secrets \\(admin_token\\)"):
        load_config(config, ControlPlaneConfig)
    both = written(tmp_path / "both.yaml", {"admin_token_file": "x", "admin_token": TOKEN}, 0o600)
    with pytest.raises(ConfigError, match="give admin_token or admin_token_file, not both"):
        load_config(both, ControlPlaneConfig)
    missing = written(tmp_path / "missing.yaml", {"admin_token_file": "nowhere"}, 0o600)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(missing, ControlPlaneConfig)
