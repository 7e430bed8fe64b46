"""Loading a service's YAML configuration into a pydantic model, with errors that name the field."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ValidationError

from modelfleet.core import yamltext

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file that could not be used; the message lists every problem."""


# Keys whose value is a secret wherever they stand in a config (a router's `token` in the
# control plane's `routers`, an API key's `key`), and keys of URLs whose password is one.
SECRET_KEYS = frozenset({"admin_token", "agent_token", "push_token", "token", "key", "password"})
URL_KEYS = frozenset({"store", "limits_store", "otlp_endpoint"})
# A top-level secret given by file instead: `admin_token_file: /etc/modelfleet/admin-token`.
FILE_SUFFIX = "_file"


def load_config(path: Path, model: type[T]) -> T:
    """Read `path` as YAML and validate it as `model`; raise ConfigError naming each bad field.

    A config that holds a secret must be readable by its owner alone, as ssh and PostgreSQL
    ask of their keys: one that its group or others may read is refused, naming the file and
    what it holds (a copy of the admin token in a world-readable file was the fleet's).
    A top-level secret may be given by a file of its own instead (`admin_token_file`), held
    to the same rule."""
    try:
        data = yamltext.load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of settings")
    found = secrets_in(data)
    # Of these, the top-level secrets may come from a file of their own (`push_token_file`).
    owner_only(path, found, [name for name in found if name in SECRET_KEYS])
    data = _secret_files(data, path.parent)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(
            f"  - {'.'.join(str(p) for p in err['loc']) or '-'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path} is invalid:\n{problems}") from exc


def secrets_in(data: Any, where: str = "") -> list[str]:
    """Where in `data` (a config as read) a secret stands: `admin_token`, `routers[0].token`."""
    found: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{where}.{key}" if where else str(key)
            if isinstance(value, str):
                secret = key in SECRET_KEYS and value != ""
                if secret or (key in URL_KEYS and _has_password(value)):
                    found.append(name)
            else:
                found += secrets_in(value, name)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += secrets_in(value, f"{where}[{i}]")
    return found


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def owner_only(path: Path, secrets: list[str], by_file: list[str] | None = None) -> None:
    """Refuse `path` if it holds `secrets` and its group or others may read it; the message
    names the `<secret>_file` keys of those in `by_file` (top-level secrets of a config)."""
    if not secrets:
        return
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    if mode & 0o077:
        instead = ", ".join(f"{name}{FILE_SUFFIX}: PATH" for name in by_file or [])
        raise ConfigError(
            f"{path} holds secrets ({', '.join(secrets)}) and its group or others may read it "
            f"(mode {mode:04o}): `chmod 600 {path}`"
            + (f", or give {', '.join(by_file or [])} by a file ({instead})" if instead else "")
        )


def _secret_files(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """`data` with each top-level `<secret>_file` read into `<secret>` (a path relative to
    `base`, the config's folder); ConfigError when it cannot be, or both are given."""
    out = dict(data)
    for key, value in data.items():
        if not key.endswith(FILE_SUFFIX) or key[: -len(FILE_SUFFIX)] not in SECRET_KEYS:
            continue
        secret = key[: -len(FILE_SUFFIX)]
        if secret in data:
            raise ConfigError(f"give {secret} or {key}, not both")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: give the path of a file holding the {secret}")
        file = base / value
        owner_only(file, [secret])
        try:
            text = file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {file}: {exc.strerror}") from exc
        if not text:
            raise ConfigError(f"{key}: {file} is empty")
        out[secret] = text
        del out[key]
    return out
