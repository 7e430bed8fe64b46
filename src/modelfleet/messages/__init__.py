"""The messages that cross a process boundary, as pydantic models.

`wire.py`: between agents, the control plane and routers (reports, assignments, routing
tables). `admin.py`: the admin API's requests and answers (what `ctl` and the dashboard read).

May import: the pure core and pydantic. No I/O: a message is data.
"""
