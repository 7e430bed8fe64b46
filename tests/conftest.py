"""What every test runs under.

Files the tests write are their owner's alone, as the README's commands make them (`umask
077`): a service refuses a config that holds a secret and that others may read, and the
tests write many such configs.

The code under test is this checkout's `src`: pytest's `pythonpath` puts it first for this
process, and PYTHONPATH here for every process a test starts (`python -m modelfleet ...`).
Without it a run in a second checkout (a clone made to try a mutation) tested the installed
tree, another checkout's, and passed whatever the mutation.
"""

from __future__ import annotations

import os
from pathlib import Path

os.umask(0o077)
SRC = Path(__file__).resolve().parent.parent / "src"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
)
