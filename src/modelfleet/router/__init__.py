"""The router: the only listener applications reach. It checks API keys and their limits,
picks a ready replica, relays the answer as it comes, and tries another while nothing has
reached the client yet.

`service.py` is the process and `workers.py` its worker processes, `proxy.py` takes a request
in, `flight.py` carries it to an engine and back, `upstream.py` is its client to engines,
`balancer.py` picks, `table.py` holds the routing table the control plane pushes (`push.py`),
`cold.py` holds requests for a model with no replica, `limits/` counts per-key limits.

May import: http, security, host, the messages and the pure core; never the control plane,
the agent or the simulator (other processes: only messages pass).
"""
