"""What every engine driver is: the `EngineDriver` seam and the `Launch` it answers with."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from modelfleet.messages.wire import ShardAssignment


@dataclass(frozen=True)
class Launch:
    """What to execute for one shard, and where it answers when it is ready.

    `health_path` is probed on the engine's host and port (200 means ready); None for a shard
    that serves no HTTP (a worker rank of a replica of several shards), which counts as ready
    while it runs.
    """

    argv: list[str]
    env: dict[str, str]
    health_path: str | None = "/health"


@dataclass(frozen=True)
class Start:
    """What the agent asks of a driver for one shard.

    The engine serves HTTP on `host`:`port` (loopback when a gate serves the node's address
    for it); `address` is where its peers reach it (the node's address; `host` when None);
    `leader` is where the replica's shard 0 meets its peers ("host:port"), for a replica of
    several shards. `key` is the engine's own API key: it must refuse requests without it (its
    health check aside), passed by environment where the engine reads one, so that `ps` does
    not show it. `stop_grace` is how long the agent waits from SIGTERM to SIGKILL: an engine
    that can finish what is in flight is told to take at most a little less. `programs` are
    this node's commands for its engines, by engine name (`agent --engine-program`). `cores`:
    on a node that offers CPU slots (`agent --cpu-slots`), the cores of each of the shard's
    slots, in `shard.gpus` order; empty on a GPU node. The agent runs the engine on those cores
    alone; a driver whose engine binds its threads itself tells it which.
    """

    shard: ShardAssignment
    host: str
    port: int
    key: str
    leader: str | None = None
    address: str | None = None
    stop_grace: float = 30.0
    programs: Mapping[str, str] = field(default_factory=dict)
    cores: tuple[tuple[int, ...], ...] = ()

    @property
    def drain_s(self) -> int:
        """Whole seconds an engine may take to finish in-flight requests once told to stop:
        most of the stop grace, leaving it time to end its own processes before SIGKILL."""
        return max(1, int(self.stop_grace * 0.8))

    def program(self, default: Callable[[], list[str]]) -> list[str]:
        """The words that run the engine: the model's `program` in the catalog, else this
        node's for the engine, else `default()` (the driver's own way of finding it). NoDriver
        naming the setting when its program is not on this node."""
        engine = self.shard.engine
        if self.shard.program is not None:
            text, where = self.shard.program, f"the catalog's program for {self.shard.model!r}"
        elif engine in self.programs:
            text, where = self.programs[engine], f"this node's --engine-program {engine}=..."
        else:
            return default()
        words = shlex.split(text)
        found = shutil.which(words[0]) if words else None
        if found is None:
            raise NoDriver(f"{where} is {text!r}, and {words[:1]} is not a program on this node")
        return [found, *words[1:]]


@dataclass(frozen=True)
class AdapterApi:
    """Where an engine loads and unloads LoRA adapters at run time: each a POST of
    `{"lora_name": ..., "lora_path": ...}` (unload: the name only); and where it lists what
    it holds (an OpenAI model list, adapters with a `parent`), if it does."""

    load: str
    unload: str
    listed: str | None = None


VLLM_ADAPTERS = AdapterApi("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models")


class NoDriver(LookupError):
    """The agent cannot start this engine: no driver for it, or the engine is not installed."""


class EngineDriver(Protocol):
    """Turns a shard assignment into an engine process and a readiness probe."""

    name: str
    adapter_api: AdapterApi | None  # None: it cannot load adapters at run time

    def launch(self, start: Start) -> Launch:
        """The command for `start.shard` (see `Start`). Raises NoDriver when the engine cannot
        be started here."""
        ...


# Where the simulator and a `command` engine find their key.
ENGINE_KEY_ENV = "MODELFLEET_ENGINE_KEY"

# What an engine gets of its agent's environment: what any program needs to run, to find its
# libraries and caches, and nothing else. Credentials the agent holds (its token, for one) stay
# with it; a variable an engine needs besides is named in the catalog's `env`, or passed on by
# the agent's `--pass-env NAME`.
BASE_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "XDG_CACHE_HOME",
)


def engine_environment(
    launch_env: Mapping[str, str], host_env: Mapping[str, str], passed: Sequence[str] = ()
) -> dict[str, str]:
    """The whole environment an engine is started with: of the agent's own (`host_env`) the
    names in BASE_ENV and `passed`, then what the driver and the catalog set (`launch_env`)."""
    names = (*BASE_ENV, *passed)
    return {**{n: host_env[n] for n in names if n in host_env}, **launch_env}


def gpu_env(shard: ShardAssignment) -> dict[str, str]:
    """The shard's GPUs, numbered as NVML numbers them (PCI bus order), and its own env."""
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in shard.gpus),
        **shard.env,
    }


def core_list(cores: Sequence[int]) -> str:
    """Cores as Linux writes CPU lists: `0-3,8`."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


class BadCores(ValueError):
    """A CPU list that could not be read."""


def parse_cores(text: str) -> tuple[int, ...]:
    """A CPU list as Linux writes them (`0-3,8`), sorted; BadCores saying what is wrong."""
    cores: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise BadCores(f"{text!r} is not a CPU list; write it as Linux does, e.g. 0-3,8")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise BadCores(f"{part.strip()!r} in {text!r} runs backwards")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def split_leader(shard: ShardAssignment, leader: str | None) -> tuple[str, str]:
    """(host, port) of shard 0's rendezvous; NoDriver when a replica of several shards has none."""
    host, sep, port = (leader or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise NoDriver(f"shard {shard.rank} of {shard.num_shards} has no address of shard 0")
    return host, port


def executable(name: str) -> str:
    """The path of `name` on PATH; NoDriver naming it when it is not there."""
    found = shutil.which(name)
    if found is None:
        raise NoDriver(f"`{name}` is not on this node's PATH; install it or use engine 'command'")
    return found


def importable(module: str, package: str) -> None:
    """NoDriver naming `package` when `module` cannot be imported by the agent's Python."""
    if importlib.util.find_spec(module) is None:
        raise NoDriver(f"{package} is not installed in the agent's Python ({module} not found)")
