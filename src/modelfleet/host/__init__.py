"""The machine a process runs on: processes and their ports (`processes.py`), network
namespaces standing in for hosts (`hosts.py`), addresses (`network.py`), files written whole
(`files.py`), one owner per state dir (`statedir.py`), a PostgreSQL of our own
(`pgserver.py`), the clock (`clock.py`), services' YAML configs (`config.py`), and systemd
units (`install.py`).

May import: the standard library, the messages and the pure core.
"""
