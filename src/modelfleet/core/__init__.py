"""The pure core: what the fleet should be and how to get there, as functions of their inputs.

The catalog (`catalog.py`), placement of a replica's shards on GPUs (`placement.py`), the
reconciler's plan (`reconcile.py`), autoscaling (`autoscale.py`), which replica holds which
adapter (`residency.py`), the fleet's nodes and marks (`fleet.py`), and small rules they share
(`units.py`, `backoff.py`, `throttle.py`, `yamltext.py`).

May import: the standard library's pure parts, pydantic and yaml, and itself. No I/O and no
clock of its own (`now` is passed in): the import contract "The pure core does no I/O and
reads no clock" forbids asyncio, os, socket, time and every HTTP library here.
"""
