"""The agent: one per GPU machine. It finds its GPUs, reports them and its engines to the
control plane, starts, probes, restarts and stops the engines it is assigned, and keeps a
record of them so that a restarted agent adopts what runs.

`service.py` is the process (its listeners and loops), `heartbeat.py` its exchange with the
control plane, `supervisor.py` one shard's engine, `gpus.py` NVML or simulated GPUs, `use.py`
what simulated GPUs hold, `adapters.py` LoRA adapters, `gate.py` the TLS gate in front of an
engine, `records.py` shards.json, `logs.py` engine output, `credential.py` the node's identity.

May import: engines, http, security, host, the messages and the pure core; never the control
plane, the router or the simulator (they are other processes: only messages pass).
"""
