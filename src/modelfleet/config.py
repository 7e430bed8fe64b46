"""Loading a service's YAML configuration into a pydantic model, with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)
# libyaml's parser where PyYAML was built with it: the pure-Python one took half a second over
# a control plane's config naming 10,000 known nodes.
SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(ValueError):
    """A configuration file that could not be used; the message lists every problem."""


def load_config(path: Path, model: type[T]) -> T:
    """Read `path` as YAML and validate it as `model`; raise ConfigError naming each bad field."""
    try:
        data = yaml.load(path.read_text(), Loader=SafeLoader) or {}
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
