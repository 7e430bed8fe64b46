"""When an agent sends its whole report and when only a heartbeat.

A report goes when something in it changed since the last one the control plane took; a
heartbeat otherwise. A GPU's memory in use drifts by a few MiB at a time on a real GPU, and
the control plane places by whole GiB: such drift alone sends no report.
"""

from __future__ import annotations

from modelfleet.wire import AgentReport

MEMORY_DRIFT = 1 << 30  # bytes a GPU's memory in use may move before a report goes


def needs_report(taken: AgentReport | None, now: AgentReport) -> bool:
    """Whether `now` must go as a whole report: the control plane holds none of this agent
    run (`taken` is None), or something in it changed since `taken`, bar small memory drift."""
    if taken is None or taken.boot_id != now.boot_id:
        return True
    if (taken.address, taken.labels, taken.shards) != (now.address, now.labels, now.shards):
        return True
    if len(taken.gpus) != len(now.gpus):
        return True
    for was, gpu in zip(taken.gpus, now.gpus, strict=True):
        if abs(was.memory_used - gpu.memory_used) > MEMORY_DRIFT:
            return True
        if was.model_copy(update={"memory_used": gpu.memory_used}) != gpu:
            return True
    return False
