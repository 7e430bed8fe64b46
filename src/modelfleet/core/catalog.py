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
import re
import reprlib
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    ValidationError,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from modelfleet.core import yamltext
from modelfleet.core.autoscale import Policy
from modelfleet.core.units import BadDuration, BadSize, parse_duration, parse_size

Engine = Literal["vllm", "sglang", "llamacpp", "sim", "command"]
ENGINES: tuple[str, ...] = get_args(Engine)
DEFAULT_STARTUP_TIMEOUT_S = 600.0

Placement = Literal["spread", "pack"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
Routing = Literal["least_load", "prefix"]
ROUTINGS: tuple[str, ...] = get_args(Routing)
OverCap = Literal["reject", "clamp"]
OVER_CAPS: tuple[str, ...] = get_args(OverCap)
IdleAction = Literal["stop", "sleep"]
IDLE_ACTIONS: tuple[str, ...] = get_args(IdleAction)
# Engines with vLLM's sleep mode (`--enable-sleep-mode`, POST /sleep and /wake_up).
SLEEPING_ENGINES = ("vllm", "sim")
# Engines that load LoRA adapters at run time (vLLM's and SGLang's load_lora_adapter).
ADAPTER_ENGINES = ("vllm", "sglang", "sim")
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16  # vLLM's own default for --max-lora-rank
# The LoRA ranks an engine accepts as its largest, where it accepts only some: vLLM's
# `--max-lora-rank` is one of these (its `MaxLoRARanks`); it refuses to start otherwise.
LORA_RANKS: dict[str, tuple[int, ...]] = {"vllm": (1, 8, 16, 32, 64, 128, 256, 320, 512)}
# Keys read by the routers only: changing them re-routes, never restarts an engine.
_ROUTER_KEYS = ("routing", "first_byte_timeout", "max_tokens_cap", "max_tokens_over_cap")
# Keys of a model that follows its load: the control plane and the routers read them; changing
# them changes the replica count and how requests are held, never an engine.
_SCALING_KEYS = ("autoscale", "cold_queue", "cold_timeout", "sleep_level")
# LoRA adapters are loaded into running engines: adding or removing one restarts nothing (how
# many an engine holds, `max_loras`, and their largest rank are its flags: those do).
_LIVE_KEYS = ("adapters",)
DEFAULT_COLD_QUEUE = 256
_TOP_KEYS = ("models",)
# What `ctl catalog show -o json` prints beside the models: taken back and ignored (the
# control plane numbers, digests and dates each catalog it applies itself).
_SHOWN_KEYS = ("version", "digest", "applied_at", "source", "last_rejection")


# A refused catalog's problems are stored, logged and sent back: each is kept short, and at
# most this many are listed, so that a small file (of nested YAML aliases, say) cannot make
# an error of megabytes.
MAX_PROBLEMS = 50
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a catalog: which model, which field, and what is wrong (each cut
    to a length that reads on one line)."""

    model: str
    field: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _clip(self.model, 80))
        object.__setattr__(self, "field", _clip(self.field, 80))
        object.__setattr__(self, "message", _clip(self.message, 300))

    def __str__(self) -> str:
        return f"model {self.model}: {self.field}: {self.message}"


class CatalogInvalid(ValueError):
    """A catalog was refused. `problems` lists every problem found, not only the first (up to
    MAX_PROBLEMS; the message says how many more there were)."""

    def __init__(self, problems: Sequence[Problem], source: str = "catalog") -> None:
        self.problems = tuple(problems[:MAX_PROBLEMS])
        self.source = _clip(source, 200)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        more = len(problems) - len(self.problems)
        if more:
            lines += f"\n  - ... and {more} more"
        super().__init__(f"{self.source} is invalid ({len(problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter of a model: requests name it as their `model`; engines load it from
    `source` (a path on the nodes, or a name the engine resolves)."""

    name: str
    source: str
    max_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "max_rank": self.max_rank}


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
    max_parallel: int = 1  # replicas being replaced that may be starting at once
    # How the routers serve it: least loaded replica, or prompts sharing a prefix to the same
    # replica (bounded by load); the time to the first byte before another replica is tried
    # (None: the router's default); a cap on `max_tokens` and what a request over it gets.
    routing: Routing = "least_load"
    first_byte_timeout: float | None = None
    max_tokens_cap: int | None = None
    max_tokens_over_cap: OverCap = "reject"
    # A model that follows its load: its replica count is the control plane's, within these
    # bounds (`replicas` is then the least, `autoscale.min`). At zero replicas a router holds
    # up to `cold_queue` of its requests for up to `cold_timeout` seconds while one starts.
    autoscale: Policy | None = None
    cold_queue: int = DEFAULT_COLD_QUEUE
    cold_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    # What a replica it no longer needs does: stop, or sleep (its engine keeps running with
    # its GPU memory freed, and wakes in seconds instead of loading anew). At level 1 the
    # engine keeps its weights in host memory and its GPUs stay its own; at level 2 it drops
    # them, and its GPUs are given to a replica of another model that has no room otherwise.
    idle_action: IdleAction = "stop"
    sleep_level: int = 1
    # LoRA adapters on this base model, loaded into its engines at run time, each replica
    # holding at most `max_loras` (None: its engines are started without LoRA), of rank at
    # most `max_lora_rank`.
    adapters: tuple[Adapter, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # The command that runs its engine, in shell words (`/opt/vllm/bin/vllm`, `python3.12 -m
    # sglang.launch_server`); None: the node's own (`agent --engine-program`), else the
    # driver's default.
    program: str | None = None

    def adapter(self, name: str) -> Adapter | None:
        """This model's adapter called `name`, if it has one."""
        return next((a for a in self.adapters if a.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The model as plain data, in the catalog file's own keys."""
        if self.autoscale is not None:
            a = self.autoscale
            scaling: dict[str, Any] = {
                "autoscale": {
                    "min": a.min,
                    "max": a.max,
                    "target_in_flight": a.target_in_flight,
                    "scale_up_after": a.scale_up_after,
                    "scale_down_after": a.scale_down_after,
                    "scale_to_zero_after": a.scale_to_zero_after,
                },
                "cold_queue": self.cold_queue,
                "cold_timeout": self.cold_timeout,
                "idle_action": self.idle_action,
            }
            if self.idle_action == "sleep":  # a sleep level belongs to sleeping alone
                scaling["sleep_level"] = self.sleep_level
        else:
            scaling = {"replicas": self.replicas}
        lora: dict[str, Any] = {}
        if self.max_loras is not None:
            lora = {
                "adapters": [a.to_dict() for a in self.adapters],
                "max_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank,
            }
        return {
            "name": self.name,
            "engine": self.engine,
            "source": self.source,
            "args": list(self.args),
            "env": dict(self.env),
            "command": self.command,
            **scaling,
            "shards": self.shards,
            "gpus_per_shard": self.gpus_per_shard,
            "gpu_memory": self.gpu_memory,
            "gpu_model": self.gpu_model,
            "node_labels": dict(self.node_labels),
            "placement": self.placement,
            "startup_timeout": self.startup_timeout,
            "max_parallel": self.max_parallel,
            "routing": self.routing,
            "first_byte_timeout": self.first_byte_timeout,
            "max_tokens_cap": self.max_tokens_cap,
            "max_tokens_over_cap": self.max_tokens_over_cap,
            **lora,
            # Only when set: a model without one keeps the engine digest it had before
            # `program` existed, so its running replicas are not replaced.
            **({"program": self.program} if self.program is not None else {}),
        }

    @cached_property
    def engine_digest(self) -> str:
        """Digest of what an engine process of this model is started from.

        Two specs with the same engine digest run identical engines; a change of it (engine,
        arguments, environment, GPU needs) means replicas must be replaced, while a change of
        the replica count alone only scales.
        """
        data = self.to_dict()
        for key in ("placement", "node_labels", "startup_timeout", "max_parallel"):
            data.pop(key)
        for key in ("replicas", *_SCALING_KEYS, *_ROUTER_KEYS, *_LIVE_KEYS):
            data.pop(key, None)
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
        problems += _clashing_names(specs)
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
            data = yamltext.load(text)
        except yaml.YAMLError as exc:
            raise CatalogInvalid([Problem("-", "-", f"not valid YAML: {exc}")], source) from exc
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise CatalogInvalid(
                [Problem("-", "-", "the file must be a mapping with a 'models' list")], source
            )
        problems = [
            Problem("-", _clip(str(key), 80), _unknown_key_message(_clip(str(key), 80), _TOP_KEYS))
            for key in data
            if key not in _TOP_KEYS and key not in _SHOWN_KEYS
        ]
        models: Any = data.get("models")
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
        """The catalog as plain data: what `from_dict` (and `from_yaml`) read back to an equal
        catalog."""
        return {"models": [m.to_dict() for m in self.models]}

    def to_yaml(self) -> str:
        """The catalog as a catalog file (every default filled in, fields that are None left
        out): what `from_yaml` reads back to an equal catalog."""

        def tidy(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: tidy(v) for k, v in value.items() if v is not None}
            if isinstance(value, list):
                return [tidy(v) for v in value]
            return value

        return yaml.dump(tidy(self.to_dict()), Dumper=_Dumper, sort_keys=False, allow_unicode=True)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], version: int = 1, source: str = "catalog"
    ) -> Catalog:
        """Read back what `to_dict` wrote (a stored catalog); raises `CatalogInvalid`.

        Until the fix that came with this method, `to_dict` wrote `sleep_level: 1` for every
        model with autoscale, a key validation refuses unless `idle_action: sleep`: a store
        written then could not be opened again. That key, beside any other idle action, is
        dropped here (it was always the default, 1, and meant nothing).
        """
        models = data.get("models")
        if isinstance(models, list):
            models = [_without_stray_sleep_level(m) for m in models]
        return cls.new(models if models is not None else [], version=version, source=source)


class _Dumper(yaml.SafeDumper):
    """PyYAML writes a NEL or a line or paragraph separator unescaped, and reads it back as a
    line break (found by the round-trip property test): text with a character that does not
    print is written escaped, in double quotes."""


def _text_node(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if not value.isprintable() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text_node)


def _without_stray_sleep_level(model: Any) -> Any:
    if (
        isinstance(model, Mapping)
        and model.get("idle_action") != "sleep"
        and "sleep_level" in model
    ):
        return {k: v for k, v in model.items() if k != "sleep_level"}
    return model


def _clashing_names(specs: Sequence[ModelSpec]) -> list[Problem]:
    """An adapter named as a model, or as another model's adapter: a request's `model` must
    name one thing."""
    owner: dict[str, str] = {m.name: "a model" for m in specs}
    problems = []
    for spec in specs:
        for adapter in spec.adapters:
            other = owner.get(adapter.name)
            if other is not None and other != f"an adapter of {spec.name}":
                problems.append(
                    Problem(
                        spec.name,
                        "adapters",
                        f"adapter name {adapter.name!r} is already {other}: a request's model "
                        "must name one thing",
                    )
                )
            owner.setdefault(adapter.name, f"an adapter of {spec.name}")
    return problems


def _digest(data: Any) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _unknown_key_message(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key{hint}"


def _size(value: object) -> int:
    try:
        return parse_size(value)
    except BadSize as exc:
        raise PydanticCustomError("size", str(exc)) from exc


def _duration(value: object) -> object:
    """A duration as a number of seconds, or as text such as "300s" or "10m"."""
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except BadDuration as exc:
            raise PydanticCustomError("duration", str(exc)) from exc
    return value


# A model's or adapter's name, as a catalog gives it and a request asks for it: it becomes a
# metric label, a usage row, a path an engine may load from and text on the dashboard.
NAME_MAX = 128
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9_.:@+-]*"
_NAME = re.compile(rf"{_NAME_PART}(/{_NAME_PART})*")


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as a model's or adapter's name; None when nothing is."""
    if len(name) > NAME_MAX:
        return f"{reprlib.repr(name)} is {len(name)} characters long; a name has at most {NAME_MAX}"
    if not _NAME.fullmatch(name):
        return (
            f"{name!r} is no name: letters, digits and . _ - : @ + in parts split by /, each "
            "part starting with a letter or digit (such as meta-llama/Llama-3.1-8B)"
        )
    return None


def _name(value: str) -> str:
    if (problem := name_problem(value)) is not None:
        raise PydanticCustomError("name", problem)
    return value


_Seconds = Annotated[float, BeforeValidator(_duration)]
_Text = Annotated[str, StringConstraints(strip_whitespace=False, min_length=1, pattern=r"\S")]
_Name = Annotated[str, AfterValidator(_name)]


class _AutoscaleInput(BaseModel):
    """A model's `autoscale` mapping as a catalog file writes it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    min: NonNegativeInt = 0
    max: PositiveInt
    target_in_flight: PositiveFloat
    scale_up_after: Annotated[_Seconds, Field(ge=0)] = 2.0
    scale_down_after: Annotated[_Seconds, Field(ge=0)] = 300.0
    scale_to_zero_after: Annotated[_Seconds, Field(ge=0)] = 600.0


class _AdapterInput(BaseModel):
    """One of a model's `adapters` as a catalog file writes it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: _Name
    source: _Text
    max_rank: PositiveInt | None = None


_Scalar = str | int | float  # YAML reads `8192` and `0.9` as numbers; they are kept as text


class _ModelInput(BaseModel):
    """One model as a catalog file writes it: what `Catalog.new` validates each entry with."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: _Name
    engine: Engine
    source: _Text | None = None
    args: list[_Scalar] = []
    env: dict[str, _Scalar] = {}
    command: _Text | None = None
    program: _Text | None = None
    replicas: PositiveInt = 1
    shards: PositiveInt = 1
    gpus_per_shard: PositiveInt = 1
    gpu_memory: Annotated[int, BeforeValidator(_size)] = 0
    gpu_model: _Text | None = None
    node_labels: dict[str, _Scalar] = {}
    placement: Placement = "spread"
    startup_timeout: PositiveFloat = DEFAULT_STARTUP_TIMEOUT_S
    max_parallel: PositiveInt = 1
    routing: Routing = "least_load"
    first_byte_timeout: PositiveFloat | None = None
    max_tokens_cap: PositiveInt | None = None
    max_tokens_over_cap: OverCap = "reject"
    autoscale: _AutoscaleInput | None = None
    cold_queue: PositiveInt = DEFAULT_COLD_QUEUE
    cold_timeout: Annotated[_Seconds, Field(gt=0)] | None = None
    idle_action: IdleAction = "stop"
    sleep_level: Literal[1, 2] = 1
    adapters: list[_AdapterInput] = []
    max_loras: PositiveInt | None = None
    max_lora_rank: PositiveInt = DEFAULT_MAX_LORA_RANK


_MODEL_KEYS = tuple(_ModelInput.model_fields)
_AUTOSCALE_KEYS = tuple(_AutoscaleInput.model_fields)
_ADAPTER_KEYS = tuple(_AdapterInput.model_fields)

# What each field must be, said to an operator whose value pydantic refused.
_EXPECTED = {
    "name": "must be a name (letters, digits and . _ - : @ + in parts split by /)",
    "source": "must be a non-empty string",
    "args": "must be a list of strings",
    "env": "must be a mapping of strings to strings",
    "command": "must be a non-empty string",
    "program": "must be a non-empty string (the command that runs the engine)",
    "replicas": "must be a positive integer",
    "shards": "must be a positive integer",
    "gpus_per_shard": "must be a positive integer",
    "gpu_model": "must be a non-empty string",
    "node_labels": "must be a mapping of strings to strings",
    "placement": f"must be one of {', '.join(PLACEMENTS)}",
    "startup_timeout": "must be a positive number of seconds",
    "max_parallel": "must be a positive integer",
    "routing": f"must be one of {', '.join(ROUTINGS)}",
    "first_byte_timeout": "must be a positive number of seconds",
    "max_tokens_cap": "must be a positive integer",
    "max_tokens_over_cap": f"must be one of {', '.join(OVER_CAPS)}",
    "autoscale": (
        "must be a mapping of min, max, target_in_flight, scale_up_after, scale_down_after, "
        "scale_to_zero_after"
    ),
    "cold_queue": "must be a positive integer (requests held per router while none serves)",
    "cold_timeout": "must be a positive duration, such as 120 or 2m",
    "idle_action": f"must be one of {', '.join(IDLE_ACTIONS)}",
    "sleep_level": "must be 1 (weights kept in host memory) or 2 (weights dropped)",
    "adapters": "must be a list of adapters, each a mapping of name, source and max_rank",
    "max_loras": "must be a positive integer (adapters each replica holds at once)",
    "max_lora_rank": "must be a positive integer (the largest rank of its adapters)",
}
_ADAPTER_EXPECTED = {
    "name": "must be a name (letters, digits and . _ - : @ + in parts split by /)",
    "source": "must be a non-empty string (a path on the nodes, or a name the engine resolves)",
    "max_rank": "must be a positive integer",
}
_AUTOSCALE_EXPECTED = {
    "min": "must be an integer of at least 0",
    "max": "must be a positive integer",
    "target_in_flight": "must be a positive number (requests in flight per replica)",
    "scale_up_after": "must be a duration of at least 0, such as 2 or 2s",
    "scale_down_after": "must be a duration of at least 0, such as 300 or 5m",
    "scale_to_zero_after": "must be a duration of at least 0, such as 600 or 10m",
}


def _problem_message(key: str, error: ErrorDetails, raw: Mapping[str, Any]) -> str:
    """What an operator reads for pydantic's `error` about field `key` of model `raw`."""
    kind = error["type"]
    if key == "autoscale" and len(error["loc"]) > 1 and isinstance(raw.get(key), Mapping):
        inner = str(error["loc"][1])
        if kind == "extra_forbidden":
            return f"{inner}: {_unknown_key_message(inner, _AUTOSCALE_KEYS)}"
        if kind == "missing":
            return f"{inner}: missing"
        if kind == "duration":
            return f"{inner}: {error['msg']}"
        expected = _AUTOSCALE_EXPECTED.get(inner, error["msg"])
        return f"{inner}: {expected}, got {_REPR.repr(raw[key].get(inner))}"
    if key == "adapters" and len(error["loc"]) > 1 and isinstance(raw.get(key), list):
        number = int(error["loc"][1]) if isinstance(error["loc"][1], int) else 0
        entry = raw[key][number] if number < len(raw[key]) else None
        if len(error["loc"]) == 2 or not isinstance(entry, Mapping):
            return f"#{number + 1}: must be a mapping of name, source and max_rank"
        inner = str(error["loc"][2])
        if kind == "extra_forbidden":
            return f"#{number + 1}: {inner}: {_unknown_key_message(inner, _ADAPTER_KEYS)}"
        if kind == "missing":
            return f"#{number + 1}: {inner}: missing"
        if kind == "name":
            return f"#{number + 1}: {inner}: {error['msg']}"
        expected = _ADAPTER_EXPECTED.get(inner, error["msg"])
        return f"#{number + 1}: {inner}: {expected}, got {_REPR.repr(entry.get(inner))}"
    if kind == "extra_forbidden":
        return _unknown_key_message(key, _MODEL_KEYS)
    if kind == "missing":
        return f"missing; one of {', '.join(ENGINES)}" if key == "engine" else "missing"
    if key == "engine":
        engine = raw.get("engine")
        close = difflib.get_close_matches(engine, ENGINES, n=1) if isinstance(engine, str) else []
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"unknown engine {_REPR.repr(engine)}; one of {', '.join(ENGINES)}{hint}"
    if key == "gpu_memory" or kind in ("duration", "name"):
        return error["msg"]
    return f"{_EXPECTED.get(key, error['msg'])}, got {_REPR.repr(raw.get(key))}"


def _is_text(value: Any) -> bool:
    """Whether every string in `value` (and in its lists and mappings) encodes as UTF-8."""
    if isinstance(value, str):
        return value.isascii() or not any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, Mapping):
        return all(_is_text(k) and _is_text(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_is_text(v) for v in value)
    return True


def _unset_nulls(raw: Mapping[Any, Any]) -> dict[Any, Any]:
    """A model's keys without those whose value is null, in its `autoscale` mapping and its
    `adapters` too: a null means "unset" (the default), as `ctl catalog show -o json` writes
    the fields a model leaves unset."""

    def present(entry: Any) -> Any:
        if isinstance(entry, Mapping):
            return {k: v for k, v in entry.items() if v is not None}
        return entry

    kept = present(raw)
    if isinstance(kept.get("autoscale"), Mapping):
        kept["autoscale"] = present(kept["autoscale"])
    if isinstance(kept.get("adapters"), list):
        kept["adapters"] = [present(a) for a in kept["adapters"]]
    return kept  # type: ignore[no-any-return]


def _validate_model(index: int, raw: Any, problems: list[Problem]) -> ModelSpec | None:
    label = f"#{index + 1}"
    if not isinstance(raw, Mapping):
        problems.append(Problem(label, "-", f"must be a mapping of keys, got {type(raw).__name__}"))
        return None
    raw = _unset_nulls(raw)
    name = raw.get("name")
    if isinstance(name, str) and name.strip() and not any(c.isspace() for c in name):
        label = name
    before = len(problems)
    try:
        model = _ModelInput.model_validate(raw)
    except ValidationError as exc:
        seen: set[tuple[str, str]] = set()  # one problem per field (of autoscale: each of its)
        for error in exc.errors():
            loc = error["loc"]
            key = _clip(str(loc[0]), 80) if loc else "-"
            inner = loc[1:3] if key in ("autoscale", "adapters") else ()
            field_of = (key, ".".join(str(part) for part in inner))
            if field_of not in seen:
                seen.add(field_of)
                problems.append(Problem(label, key, _problem_message(key, error, raw)))
        return None

    max_loras = model.max_loras
    if max_loras is None and model.adapters:
        max_loras = DEFAULT_MAX_LORAS
    for rules in (_text_problems, _engine_problems, _scaling_problems, _adapter_problems):
        for key, message in rules(model, raw, max_loras):
            problems.append(Problem(label, key, message))
    if len(problems) > before:
        return None
    return _spec(model, max_loras)


def _spec(model: _ModelInput, max_loras: int | None) -> ModelSpec:
    """The spec of a model input that broke no rule."""
    scaling = model.autoscale
    return ModelSpec(
        name=model.name,
        engine=model.engine,
        source=model.source or model.name,
        args=tuple(str(a) for a in model.args),
        env=MappingProxyType({k: str(v) for k, v in model.env.items()}),
        command=model.command,
        replicas=model.replicas if scaling is None else scaling.min,
        shards=model.shards,
        gpus_per_shard=model.gpus_per_shard,
        gpu_memory=model.gpu_memory,
        gpu_model=model.gpu_model,
        node_labels=MappingProxyType({k: str(v) for k, v in model.node_labels.items()}),
        placement=model.placement,
        startup_timeout=float(model.startup_timeout),
        max_parallel=model.max_parallel,
        routing=model.routing,
        first_byte_timeout=(
            None if model.first_byte_timeout is None else float(model.first_byte_timeout)
        ),
        max_tokens_cap=model.max_tokens_cap,
        max_tokens_over_cap=model.max_tokens_over_cap,
        autoscale=None
        if scaling is None
        else Policy(
            min=scaling.min,
            max=scaling.max,
            target_in_flight=float(scaling.target_in_flight),
            scale_up_after=float(scaling.scale_up_after),
            scale_down_after=float(scaling.scale_down_after),
            scale_to_zero_after=float(scaling.scale_to_zero_after),
        ),
        cold_queue=model.cold_queue,
        cold_timeout=float(
            model.startup_timeout if model.cold_timeout is None else model.cold_timeout
        ),
        idle_action=model.idle_action,
        sleep_level=model.sleep_level,
        adapters=tuple(Adapter(a.name, a.source, a.max_rank) for a in model.adapters),
        max_loras=max_loras,
        max_lora_rank=model.max_lora_rank,
        program=model.program,
    )


# Rules across a model's fields, each yielding (field, what is wrong) for every break.
Found = Iterator[tuple[str, str]]


def _text_problems(model: _ModelInput, raw: Mapping[Any, Any], max_loras: int | None) -> Found:
    for key, value in raw.items():
        if not _is_text(value):
            yield (
                _clip(str(key), 80),
                "holds a string that is not valid Unicode (a lone surrogate, such as \\ud800, "
                "from a JSON escape): an engine's command line or environment cannot carry it",
            )


def _engine_problems(model: _ModelInput, raw: Mapping[Any, Any], max_loras: int | None) -> Found:
    if model.engine == "command" and model.command is None:
        yield "command", "missing: engine 'command' needs a command template"
    if model.engine != "command" and model.command is not None:
        yield "command", f"only engine 'command' takes a command template, not {model.engine!r}"
    if model.program is not None:
        if model.engine == "command":
            yield "program", "engine 'command' names its program in its command template"
        else:
            try:
                if not shlex.split(model.program):
                    yield "program", "must name a program, got only blanks"
            except ValueError as exc:
                yield "program", f"cannot be split into words like a shell would: {exc}"
    if model.engine == "llamacpp" and model.shards > 1:
        yield "shards", f"engine 'llamacpp' runs one shard per replica, got {model.shards}"


def _scaling_problems(model: _ModelInput, raw: Mapping[Any, Any], max_loras: int | None) -> Found:
    scaling = model.autoscale
    if scaling is not None and "replicas" in raw:
        yield (
            "replicas",
            "a model with autoscale has no fixed count: autoscale's min and max bound the "
            "replicas the control plane runs; give one or the other",
        )
    if scaling is not None and scaling.min > scaling.max:
        yield "autoscale", f"min ({scaling.min}) is more than max ({scaling.max})"
    if scaling is None:
        for key in ("cold_queue", "cold_timeout"):
            if key in raw:
                yield key, "only a model with autoscale holds requests while it has no replica"
        for key in ("idle_action", "sleep_level"):
            if key in raw:
                yield key, "only a model with autoscale has replicas it no longer needs"
    if model.idle_action == "sleep" and model.engine not in SLEEPING_ENGINES:
        yield (
            "idle_action",
            f"engine {model.engine!r} has no sleep mode; sleep works with "
            f"{', '.join(SLEEPING_ENGINES)} (use idle_action: stop)",
        )
    if model.idle_action == "sleep" and model.shards > 1:
        yield "idle_action", "sleep is for replicas of one shard; use idle_action: stop"
    if "sleep_level" in raw and model.idle_action != "sleep":
        yield "sleep_level", "only idle_action: sleep has a sleep level"


def _adapter_problems(model: _ModelInput, raw: Mapping[Any, Any], max_loras: int | None) -> Found:
    if max_loras is not None and model.engine not in ADAPTER_ENGINES:
        yield (
            "adapters" if model.adapters else "max_loras",
            f"engine {model.engine!r} cannot load LoRA adapters at run time; adapters work "
            f"with {', '.join(ADAPTER_ENGINES)}",
        )
    if "max_lora_rank" in raw and max_loras is None:
        yield "max_lora_rank", "only a model with adapters or max_loras has a LoRA rank"
    ranks = LORA_RANKS.get(model.engine)
    if max_loras is not None and ranks is not None and model.max_lora_rank not in ranks:
        higher = [r for r in ranks if r >= model.max_lora_rank]
        hint = f"; the next one up is {higher[0]}" if higher else ""
        yield (
            "max_lora_rank",
            f"engine {model.engine!r} takes a max_lora_rank of "
            f"{', '.join(str(r) for r in ranks)} only, got {model.max_lora_rank}{hint}",
        )
    named: dict[str, int] = {}
    for number, adapter in enumerate(model.adapters, 1):
        if adapter.name in named:
            yield (
                "adapters",
                f"#{number}: duplicate adapter name {adapter.name!r} (also #{named[adapter.name]})",
            )
        named.setdefault(adapter.name, number)
        if adapter.name == model.name:
            yield "adapters", f"#{number}: an adapter cannot be named as its base model"
        if adapter.max_rank is not None and adapter.max_rank > model.max_lora_rank:
            yield (
                "adapters",
                f"#{number}: max_rank {adapter.max_rank} is over the model's max_lora_rank "
                f"({model.max_lora_rank}); raise max_lora_rank (its engines restart with it)",
            )
