"""When an agent sends its whole report and when only a heartbeat, and when it tries again.

A report goes when something in it changed since the last one the control plane took; a
heartbeat otherwise. A GPU's memory in use drifts by a few MiB at a time on a real GPU, and
the control plane places by whole GiB: such drift alone sends no report, nor does a GPU's
utilisation, which changes all the time; each heartbeat carries both for the plots.
"""

from __future__ import annotations

from modelfleet.messages.wire import AgentReport

MEMORY_DRIFT = 1 << 30  # bytes a GPU's memory in use may move before a report goes
RETRY_SPREAD = 0.2  # a retry comes up to this share of the interval early or late


def needs_report(taken: AgentReport | None, now: AgentReport) -> bool:
    """Whether `now` must go as a whole report: the control plane holds none of this agent
    run (`taken` is None), or something in it changed since `taken`, bar small memory drift
    and utilisation (which heartbeats carry)."""
    if taken is None or taken.boot_id != now.boot_id:
        return True
    if (taken.address, taken.labels, taken.shards) != (now.address, now.labels, now.shards):
        return True
    if len(taken.gpus) != len(now.gpus):
        return True
    for was, gpu in zip(taken.gpus, now.gpus, strict=True):
        if abs(was.memory_used - gpu.memory_used) > MEMORY_DRIFT:
            return True
        if (
            was.model_copy(update={"memory_used": gpu.memory_used, "utilization": gpu.utilization})
            != gpu
        ):
            return True
    return False


def retry_delay(interval: float, spread: float) -> float:
    """Seconds to wait before trying a failed exchange again: `interval`, moved by up to 20 %
    either way as `spread` (in [0, 1)) says. Every agent of a fleet fails at the same moment
    when the control plane stops; without the spread they would all come back at once, every
    interval, for as long as it is down."""
    return interval * (1 - RETRY_SPREAD + 2 * RETRY_SPREAD * spread)
