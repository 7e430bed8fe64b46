"""A stand-in for nvidia-ml-py's `pynvml`: the functions NvmlGpus calls, over GPUs a test sets
up and breaks. Names, signatures and error values follow pynvml."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_FEATURE_ENABLED = 1
NVML_FEATURE_DISABLED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 10: "Timeout", 15: "GPU is lost"}.get(value, value))
        self.value = value


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * 2**30
    used: int = 0
    utilization: int | None = 0  # None: not supported
    lost: bool = False
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: not supported
    retired_pending: bool = False
    ecc_uncorrected: int = 0


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu() for _ in range(4)])
    events: list[tuple[int, int]] = field(default_factory=list)  # (gpu index, xid) pending
    initialised: bool = False

    def module(self) -> SimpleNamespace:
        """This fake as a module-like object with pynvml's names."""
        fake = self

        def handle(i: int) -> FakeGpu:
            return fake.gpus[i]

        def check(gpu: FakeGpu) -> FakeGpu:
            if gpu.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            return gpu

        def wait(_events: Any, _timeout_ms: int) -> SimpleNamespace:
            if not fake.events:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            index, xid = fake.events.pop(0)
            return SimpleNamespace(device=fake.gpus[index], eventData=xid, eventType=8)

        def remapped(gpu: FakeGpu) -> tuple[int, int, int, int]:
            if check(gpu).remapped_rows is None:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return gpu.remapped_rows  # type: ignore[return-value]

        def utilization(gpu: FakeGpu) -> SimpleNamespace:
            if check(gpu).utilization is None:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return SimpleNamespace(gpu=gpu.utilization, memory=0)

        def index_of(h: FakeGpu) -> int:
            return next(i for i, g in enumerate(fake.gpus) if g is h)

        def init() -> None:
            fake.initialised = True

        return SimpleNamespace(
            NVMLError=NVMLError,
            NVML_ERROR_GPU_IS_LOST=NVML_ERROR_GPU_IS_LOST,
            NVML_FEATURE_ENABLED=NVML_FEATURE_ENABLED,
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED=NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            NVML_VOLATILE_ECC=NVML_VOLATILE_ECC,
            nvmlEventTypeXidCriticalError=nvmlEventTypeXidCriticalError,
            nvmlInit=init,
            nvmlDeviceGetCount=lambda: len(fake.gpus),
            nvmlDeviceGetHandleByIndex=handle,
            nvmlDeviceGetIndex=index_of,
            nvmlDeviceGetName=lambda h: check(h).name,
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
                total=check(h).total, used=h.used, free=h.total - h.used
            ),
            nvmlDeviceGetUtilizationRates=utilization,
            nvmlDeviceGetRemappedRows=remapped,
            nvmlDeviceGetRetiredPagesPendingStatus=lambda h: int(check(h).retired_pending),
            nvmlDeviceGetTotalEccErrors=lambda h, _type, _counter: check(h).ecc_uncorrected,
            nvmlEventSetCreate=lambda: object(),
            nvmlDeviceRegisterEvents=lambda h, _types, _set: None,
            nvmlEventSetWait_v2=wait,
        )
