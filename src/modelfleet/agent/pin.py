"""`python -m modelfleet.agent.pin CORES -- COMMAND...`: COMMAND, run on CORES alone.

The agent starts the engine of a CPU slot through this: it sets its own CPU affinity and then
becomes the command (exec), so the engine keeps this process's pid, and every thread and
process the engine makes runs on those cores (Linux hands affinity down to each).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from modelfleet.engines.base import BadCores, core_list, parse_cores


def pinned(argv: Sequence[str], cores: Sequence[int]) -> list[str]:
    """`argv` to run on `cores` alone."""
    return [sys.executable, "-m", "modelfleet.agent.pin", core_list(cores), "--", *argv]


def main(args: Sequence[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m modelfleet.agent.pin CORES -- COMMAND...", file=sys.stderr)
        return 2
    try:
        cores = parse_cores(args[0])
        os.sched_setaffinity(0, cores)
    except (BadCores, OSError) as exc:
        print(f"modelfleet.agent.pin: cannot run on cores {args[0]}: {exc}", file=sys.stderr)
        return 1
    try:
        os.execvp(args[2], list(args[2:]))
    except OSError as exc:
        print(f"modelfleet.agent.pin: cannot start {args[2]}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
