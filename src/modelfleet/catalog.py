"""The catalog: which models should be served, and what each replica needs.

A `Catalog` is immutable and always valid: `Catalog.new` (or `Catalog.from_yaml`, which goes
through it) is the only way to build one, and it refuses an invalid one with every problem
found, each naming the model and the field. What changes at run time is *which* catalog is
current, never a catalog itself.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal

import yaml

from modelfleet.units import BadSize, parse_size

ENGINES = ("vllm", "sglang", "llamacpp", "sim", "command")
PLACEMENTS = ("spread", "pack")
DEFAULT_STARTUP_TIMEOUT_S = 600.0

Placement = Literal["spread", "pack"]

_MODEL_KEYS = (
    "name",
    "engine",
    "source",
    "args",
    "env",
    "command",
    "replicas",
    "shards",
    "gpus_per_shard",
    "gpu_memory",
    "gpu_model",
    "node_labels",
    "placement",
    "startup_timeout",
)
_TOP_KEYS = ("models",)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a catalog: which model, which field, and what is wrong."""

    model: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"model {self.model}: {self.field}: {self.message}"


class CatalogInvalid(ValueError):
    """A catalog was refused. `problems` lists every problem found, not only the first."""

    def __init__(self, problems: Sequence[Problem], source: str = "catalog") -> None:
        self.problems = tuple(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is invalid ({len(self.problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class ModelSpec:
    """One model of the catalog, validated. Build it through `Catalog.new`."""

    name: str
    engine: str
    source: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    command: str | None
    replicas: int
    shards: int
    gpus_per_shard: int
    gpu_memory: int
    gpu_model: str | None
    node_labels: Mapping[str, str]
    placement: Placement
    startup_timeout: float

    def to_dict(self) -> dict[str, Any]:
        """The model as plain data, in the catalog file's own keys."""
        return {
            "name": self.name,
            "engine": self.engine,
            "source": self.source,
            "args": list(self.args),
            "env": dict(self.env),
            "command": self.command,
            "replicas": self.replicas,
            "shards": self.shards,
            "gpus_per_shard": self.gpus_per_shard,
            "gpu_memory": self.gpu_memory,
            "gpu_model": self.gpu_model,
            "node_labels": dict(self.node_labels),
            "placement": self.placement,
            "startup_timeout": self.startup_timeout,
        }

    @cached_property
    def engine_digest(self) -> str:
        """Digest of what an engine process of this model is started from.

        Two specs with the same engine digest run identical engines; a change of it (engine,
        arguments, environment, GPU needs) means replicas must be replaced, while a change of
        the replica count alone only scales.
        """
        data = self.to_dict()
        for key in ("replicas", "placement", "node_labels", "startup_timeout"):
            data.pop(key)
        return _digest(data)


_NEW_KEY = object()


@dataclass(frozen=True)
class Catalog:
    """An immutable, validated set of models, with a version and a content digest."""

    models: tuple[ModelSpec, ...]
    version: int
    digest: str
    _key: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._key is not _NEW_KEY:
            raise TypeError("build a Catalog with Catalog.new(...) or Catalog.from_yaml(...)")

    @classmethod
    def new(
        cls, models: Sequence[Mapping[str, Any]], version: int = 1, source: str = "catalog"
    ) -> Catalog:
        """Validate `models` (a list of mappings in the catalog file's keys) into a Catalog.

        Raises `CatalogInvalid` listing every problem found.
        """
        problems: list[Problem] = []
        if isinstance(models, str | bytes) or not isinstance(models, Sequence):
            raise CatalogInvalid([Problem("-", "models", "must be a list of models")], source)
        specs: list[ModelSpec] = []
        seen: dict[str, int] = {}
        for index, raw in enumerate(models):
            spec = _validate_model(index, raw, problems)
            name = raw.get("name") if isinstance(raw, Mapping) else None
            if isinstance(name, str) and name in seen:
                problems.append(
                    Problem(
                        name,
                        "name",
                        f"duplicate model name (models #{seen[name] + 1} and #{index + 1})",
                    )
                )
                continue
            if isinstance(name, str):
                seen[name] = index
            if spec is not None:
                specs.append(spec)
        if not isinstance(version, int) or version < 1:
            problems.append(Problem("-", "version", f"must be a positive integer, got {version!r}"))
        if problems:
            raise CatalogInvalid(problems, source)
        digest = _digest([s.to_dict() for s in specs])
        return cls(models=tuple(specs), version=version, digest=digest, _key=_NEW_KEY)

    @classmethod
    def from_yaml(cls, text: str, version: int = 1, source: str = "catalog") -> Catalog:
        """Parse a catalog file (`models:` and a list of models) and validate it."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CatalogInvalid([Problem("-", "-", f"not valid YAML: {exc}")], source) from exc
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise CatalogInvalid(
                [Problem("-", "-", "the file must be a mapping with a 'models' list")], source
            )
        problems = [
            Problem("-", str(key), _unknown_key_message(str(key), _TOP_KEYS))
            for key in data
            if key not in _TOP_KEYS
        ]
        models = data.get("models")
        if models is None:
            problems.append(Problem("-", "models", "missing: the file must list its models"))
        if problems:
            raise CatalogInvalid(problems, source)
        return cls.new(models, version=version, source=source)

    @cached_property
    def by_name(self) -> Mapping[str, ModelSpec]:
        """The models keyed by name."""
        return MappingProxyType({m.name: m for m in self.models})

    def get(self, name: str) -> ModelSpec | None:
        """The model called `name`, or None when the catalog has none of that name."""
        return self.by_name.get(name)

    def with_version(self, version: int) -> Catalog:
        """The same models under another version number (for the holder of the current one)."""
        return Catalog(models=self.models, version=version, digest=self.digest, _key=_NEW_KEY)

    def to_dict(self) -> dict[str, Any]:
        """The catalog as plain data: what `from_yaml` reads back to an equal catalog."""
        return {"models": [m.to_dict() for m in self.models]}


def _digest(data: Any) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _unknown_key_message(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key{hint}"


def _validate_model(index: int, raw: Any, problems: list[Problem]) -> ModelSpec | None:
    label = f"#{index + 1}"
    if not isinstance(raw, Mapping):
        problems.append(Problem(label, "-", f"must be a mapping of keys, got {type(raw).__name__}"))
        return None
    name = raw.get("name")
    if isinstance(name, str) and name.strip() and not any(c.isspace() for c in name):
        label = name
    else:
        message = (
            "missing"
            if name is None
            else f"must be a non-empty string without spaces, got {name!r}"
        )
        problems.append(Problem(label, "name", message))
        name = None
    before = len(problems)

    def problem(key: str, message: str) -> None:
        problems.append(Problem(label, key, message))

    for key in raw:
        if key not in _MODEL_KEYS:
            problem(str(key), _unknown_key_message(str(key), _MODEL_KEYS))

    engine = raw.get("engine")
    if engine is None:
        problem("engine", f"missing; one of {', '.join(ENGINES)}")
    elif engine not in ENGINES:
        close = difflib.get_close_matches(str(engine), ENGINES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problem("engine", f"unknown engine {engine!r}; one of {', '.join(ENGINES)}{hint}")

    def positive_int(key: str) -> int:
        value = raw.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problem(key, f"must be a positive integer, got {value!r}")
            return 1
        return value

    replicas = positive_int("replicas")
    shards = positive_int("shards")
    gpus_per_shard = positive_int("gpus_per_shard")

    gpu_memory = 0
    if "gpu_memory" in raw:
        try:
            gpu_memory = parse_size(raw["gpu_memory"])
        except BadSize as exc:
            problem("gpu_memory", str(exc))

    args = raw.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str | int | float) for a in args):
        problem("args", f"must be a list of strings, got {args!r}")
        args = []

    def str_mapping(key: str) -> dict[str, str]:
        value = raw.get(key, {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | float) for k, v in value.items()
        ):
            problem(key, f"must be a mapping of strings to strings, got {value!r}")
            return {}
        return {k: str(v) for k, v in value.items()}

    env = str_mapping("env")
    node_labels = str_mapping("node_labels")

    def optional_str(key: str) -> str | None:
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            problem(key, f"must be a non-empty string, got {value!r}")
            return None
        return value

    source = optional_str("source")
    gpu_model = optional_str("gpu_model")
    command = optional_str("command")
    if engine == "command" and command is None and "command" not in raw:
        problem("command", "missing: engine 'command' needs a command template")
    if engine in ENGINES and engine != "command" and command is not None:
        problem("command", f"only engine 'command' takes a command template, not {engine!r}")
    if engine == "llamacpp" and shards > 1:
        problem("shards", f"engine 'llamacpp' runs one shard per replica, got {shards}")

    placement = raw.get("placement", "spread")
    if placement not in PLACEMENTS:
        problem("placement", f"must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        placement = "spread"

    startup_timeout = raw.get("startup_timeout", DEFAULT_STARTUP_TIMEOUT_S)
    if (
        isinstance(startup_timeout, bool)
        or not isinstance(startup_timeout, int | float)
        or startup_timeout <= 0
    ):
        problem("startup_timeout", f"must be a positive number of seconds, got {startup_timeout!r}")
        startup_timeout = DEFAULT_STARTUP_TIMEOUT_S

    if name is None or len(problems) > before:
        return None
    return ModelSpec(
        name=name,
        engine=engine,
        source=source or name,
        args=tuple(str(a) for a in args),
        env=MappingProxyType(env),
        command=command,
        replicas=replicas,
        shards=shards,
        gpus_per_shard=gpus_per_shard,
        gpu_memory=gpu_memory,
        gpu_model=gpu_model,
        node_labels=MappingProxyType(node_labels),
        placement=placement,
        startup_timeout=float(startup_timeout),
    )
