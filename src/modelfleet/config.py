"""Loading a service's YAML configuration into a pydantic model, with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from modelfleet import yamltext

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file that could not be used; the message lists every problem."""


def load_config(path: Path, model: type[T]) -> T:
    """Read `path` as YAML and validate it as `model`; raise ConfigError naming each bad field."""
    try:
        data = yamltext.load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of settings")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(
            f"  - {'.'.join(str(p) for p in err['loc']) or '-'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path} is invalid:\n{problems}") from exc
