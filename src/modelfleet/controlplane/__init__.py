"""The control plane: holds what should be (the catalog, marks, keys, in its store), learns
what is from the agents, and turns the difference into assignments for agents and a routing
table for routers.

`plane.py` is the reconcile loop and the operator's changes, `term.py` the fleet as one term
of leadership sees it, `state.py` the reports taken in, `service.py` the process; its
listeners are `agent_api.py` (for agents) and `admin_api/` (for operators, with the dashboard,
`dashboard.py`). Each other module is one concept the plane uses: catalogs, keys, usage,
events, series, loads, autoscaler, publisher, leadership, membership.

May import: the store, http, security, host, the messages and the pure core; never the agent,
the router or the simulator (other processes: only messages pass).
"""
