"""Where an agent's GPUs come from: a `GpuSource`. Here, the simulated one.

Simulated GPUs are described on the command line as `COUNTxSIZE[:MODEL]`, several groups
separated by commas: `4x80GB`, `8x80GB:H100`, `2x80GB:H100,2x40GB:A100`.
"""

from __future__ import annotations

import re
from typing import Protocol

from modelfleet.units import BadSize, parse_size
from modelfleet.wire import GpuReport

_GROUP = re.compile(r"^\s*(\d+)\s*x\s*([0-9.]+\s*[a-zA-Z]*)\s*(?::\s*(\S+))?\s*$")


class GpuSource(Protocol):
    """Something that lists a node's GPUs with their health."""

    def gpus(self) -> list[GpuReport]: ...


class BadGpuSpec(ValueError):
    """A `--simulate-gpus` value that could not be read."""


class SimulatedGpus:
    """GPUs that exist only in this agent: always present, healthy unless told otherwise."""

    def __init__(self, spec: str, unhealthy: dict[int, str] | None = None) -> None:
        self._gpus: list[GpuReport] = []
        for group in spec.split(","):
            match = _GROUP.match(group)
            if not match:
                raise BadGpuSpec(
                    f"{group.strip()!r} is not a GPU group; write COUNTxSIZE[:MODEL], e.g. 4x80GB"
                )
            count, size, model = match.groups()
            try:
                memory = parse_size(size)
            except BadSize as exc:
                raise BadGpuSpec(f"{group.strip()!r}: {exc}") from exc
            for _ in range(int(count)):
                self._gpus.append(
                    GpuReport(
                        index=len(self._gpus),
                        model=model or f"SIM-{size.strip()}",
                        memory_total=memory,
                        memory_used=0,
                    )
                )
        if not self._gpus:
            raise BadGpuSpec(f"{spec!r} describes no GPUs")
        for index, reason in (unhealthy or {}).items():
            if not 0 <= index < len(self._gpus):
                raise BadGpuSpec(
                    f"there is no GPU {index} to mark unhealthy ({len(self._gpus)} GPUs)"
                )
            self._gpus[index] = self._gpus[index].model_copy(
                update={"healthy": False, "reason": reason}
            )

    def gpus(self) -> list[GpuReport]:
        return list(self._gpus)

    def set_health(self, index: int, healthy: bool, reason: str = "") -> GpuReport:
        """Make simulated GPU `index` healthy or not (with why), as a fault would at run time."""
        if not 0 <= index < len(self._gpus):
            raise BadGpuSpec(f"there is no GPU {index} ({len(self._gpus)} GPUs)")
        if not healthy and not reason.strip():
            reason = "marked unhealthy"
        gpu = self._gpus[index].model_copy(
            update={"healthy": healthy, "reason": "" if healthy else reason.strip()}
        )
        self._gpus[index] = gpu
        return gpu
