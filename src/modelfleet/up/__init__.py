"""`modelfleet up`: a whole fleet on one machine, with simulated GPUs and engines.

It starts, in this order, a router, a control plane and two agents (`node-1`, `node-2`, four
simulated 80 GB GPUs each), each as its own process and process group, waits until every
replica of the default catalog serves through the router, and writes what a client and an
operator need to `<state-dir>/up.json`. While the fleet runs, a process of it that dies is
started again and `up.json` rewritten with its new pid. SIGINT or SIGTERM stops everything it
started, engines included, in the reverse order.

What a client and an operator were given (the API key, the admin token, the ports) is kept in
the state dir and is the same at the next `up` on it.

`configs.py` says what runs, `kept.py` what is kept across restarts, `children.py` starts and
stops processes, `fleet.py` starts a fleet in order, `restarts.py` keeps it up, `command.py`
is the command itself.

May import: the agent's records (to read what its agents run), host, security, the messages
and the pure core; never a service's code: it starts them as processes (the contract "up
starts services as processes").
"""

from modelfleet.up.children import UpError
from modelfleet.up.command import up
from modelfleet.up.configs import FleetOptions
from modelfleet.up.fleet import RunningFleet, start_fleet

__all__ = ["FleetOptions", "RunningFleet", "UpError", "start_fleet", "up"]
