"""Where an agent's GPUs come from: a `GpuSource`. NVML on a machine with NVIDIA's driver, slots
of cores on a node without GPUs, or simulated GPUs for development, tests and rehearsals.

Simulated GPUs are described on the command line as `COUNTxSIZE[:MODEL]`, several groups
separated by commas: `4x80GB`, `8x80GB:H100`, `2x80GB:H100,2x40GB:A100`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import psutil

from modelfleet.agent.use import held_memory
from modelfleet.core.units import BadSize, parse_size
from modelfleet.messages.wire import GpuReport, ShardState

_GROUP = re.compile(r"^\s*(\d+)\s*x\s*([0-9.]+\s*[a-zA-Z]*)\s*(?::\s*(\S+))?\s*$")


class GpuSource(Protocol):
    """Something that lists a node's GPUs with their health."""

    def gpus(self) -> list[GpuReport]: ...


log = logging.getLogger("modelfleet.agent")


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
                        utilization=0.0,
                    )
                )
        if not self._gpus:
            raise BadGpuSpec(f"{spec!r} describes no GPUs")
        # The GPUs and state of each engine on this node (set by its agent): what they hold.
        self.holding: Callable[[], Iterable[tuple[Sequence[int], ShardState]]] = list
        for index, reason in (unhealthy or {}).items():
            if not 0 <= index < len(self._gpus):
                raise BadGpuSpec(
                    f"there is no GPU {index} to mark unhealthy ({len(self._gpus)} GPUs)"
                )
            self._gpus[index] = self._gpus[index].model_copy(
                update={"healthy": False, "reason": reason}
            )

    def gpus(self) -> list[GpuReport]:
        held = held_memory(self.holding(), {g.index: g.memory_total for g in self._gpus})
        return [
            g.model_copy(update={"memory_used": held[g.index]}) if held[g.index] else g
            for g in self._gpus
        ]

    def set_utilization(self, index: int, utilization: float) -> None:
        """How busy the engines on GPU `index` keep it, in % (`agent/use.py`)."""
        busy = min(100.0, max(0.0, utilization))
        self._gpus[index] = self._gpus[index].model_copy(update={"utilization": busy})

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


_SLOTS = re.compile(r"^\s*(\d+)\s*(?:x\s*([0-9.]+\s*[a-zA-Z]*))?\s*$")


class CpuSlots:
    """A node without GPUs that offers its cores instead: slots of the same number of cores,
    each reported as a device of model "CPU" that a replica is placed on as on a GPU (the
    catalog's `gpus_per_shard` counts slots, `gpu_memory` is memory). Each engine runs on
    its slots' cores alone, so two replicas never share a core.

    `spec` is `CORES[xMEMORY]`: how many cores a slot has, and how much memory each offers
    (default: the node's memory shared evenly). The cores are those this agent may run on
    (`cores`, default its own CPU affinity), in order; cores left over make no slot.
    """

    def __init__(
        self, spec: str, cores: Sequence[int] | None = None, memory_total: int | None = None
    ) -> None:
        match = _SLOTS.match(spec)
        if not match or int(match.group(1)) < 1:
            raise BadGpuSpec(f"{spec!r} is not a CPU slot; write CORES[xMEMORY], e.g. 4 or 4x16GB")
        size, memory = int(match.group(1)), match.group(2)
        usable = sorted(os.sched_getaffinity(0) if cores is None else cores)
        count = len(usable) // size
        if count == 0:
            raise BadGpuSpec(f"slots of {size} cores: this agent may run on {len(usable)} only")
        if memory is not None:
            try:
                each = parse_size(memory)
            except BadSize as exc:
                raise BadGpuSpec(f"{spec!r}: {exc}") from exc
        else:
            each = psutil.virtual_memory().total if memory_total is None else memory_total
            each //= count
        self.slots = {i: tuple(usable[i * size : (i + 1) * size]) for i in range(count)}
        self._gpus = [
            GpuReport(index=i, model="CPU", memory_total=each, memory_used=0) for i in self.slots
        ]
        if len(usable) % size:
            log.warning("cores %s make no slot of %d", usable[count * size :], size)

    def gpus(self) -> list[GpuReport]:
        return list(self._gpus)


# XIDs after which a GPU is not to be trusted with work until it is reset or serviced: double
# bit ECC (48), page retirement and row remapping events (63, 64), NVLink (74), fallen off the
# bus (79), contained and uncontained ECC (94, 95), and the GPU having stopped processing or
# its firmware having failed (46, 62, 119, 120). Application errors (13, 31, 43, 45, 68) are
# the engine's, not the GPU's, and are not among them.
CRITICAL_XIDS = frozenset({46, 48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised (no NVIDIA driver, or no nvidia-ml-py)."""


class NvmlGpus:
    """The node's NVIDIA GPUs as NVML reports them.

    Each report gives every GPU's name, total and used memory, and its health. A GPU is
    unhealthy, with the reason, when NVML says it is lost, when a row remapping failed or
    waits for a reset, when retired pages wait for a reset, when it has uncorrectable ECC
    errors since the driver loaded, or once a critical XID event was seen for it (an XID
    stays until the agent restarts: the GPU needs a reset either way).

    `nvml` is the `pynvml` module of nvidia-ml-py; tests pass a fake with the same functions.
    """

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
            nvml = pynvml
        self.nvml: Any = nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML: {exc}") from exc
        self._xids: dict[int, str] = {}
        self._events = self._watch_xids()

    def _watch_xids(self) -> Any:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError as exc:
            log.warning("NVML: XID events cannot be watched (%s); other health checks stand", exc)
            return None
        return events

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nvml = self.nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:
                return  # a timeout: nothing more waiting
            xid = int(data.eventData)
            if xid not in CRITICAL_XIDS:
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                continue
            if index not in self._xids:
                self._xids[index] = f"XID {xid}"
                log.error("gpu %d: critical XID %d; excluded until a restart", index, xid)

    def gpus(self) -> list[GpuReport]:
        self._drain_xids()
        return [self._gpu(index, handle) for index, handle in enumerate(self._handles)]

    def _gpu(self, index: int, handle: Any) -> GpuReport:
        nvml = self.nvml
        try:
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as exc:
            lost = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", None)
            reason = "NVML: GPU is lost" if getattr(exc, "value", None) == lost else f"NVML: {exc}"
            return GpuReport(
                index=index,
                model="unknown",
                memory_total=0,
                memory_used=0,
                healthy=False,
                reason=reason,
            )
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        reasons = self._faults(handle)
        if index in self._xids:
            reasons.insert(0, self._xids[index])
        try:
            utilization: float | None = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            utilization = None
        return GpuReport(
            index=index,
            model=str(name),
            memory_total=int(memory.total),
            memory_used=int(memory.used),
            healthy=not reasons,
            reason="; ".join(reasons),
            utilization=utilization,
        )

    def _faults(self, handle: Any) -> list[str]:
        """What NVML says is wrong with the GPU's memory; a check it does not support is skipped."""
        nvml = self.nvml
        faults = []
        try:
            _, _, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
            if failed:
                faults.append("row remapping failed")
            elif pending:
                faults.append("row remapping pending: reset the GPU")
        except nvml.NVMLError:
            pass
        try:
            if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED:
                faults.append("retired pages pending: reset the GPU")
        except nvml.NVMLError:
            pass
        try:
            errors = nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
            if errors:
                faults.append(f"{errors} uncorrectable ECC error(s)")
        except nvml.NVMLError:
            pass
        return faults
