"""What every test runs under.

Files the tests write are their owner's alone, as the README's commands make them (`umask
077`): a service refuses a config that holds a secret and that others may read, and the
tests write many such configs.
"""

from __future__ import annotations

import os

os.umask(0o077)
