"""An engine given as a command template in the catalog."""

from __future__ import annotations

import shlex

from modelfleet.engines.base import ENGINE_KEY_ENV, AdapterApi, Launch, NoDriver, Start, gpu_env


class CommandDriver:
    """The template may use {model}, {source}, {host}, {port}, {rank}, {num_shards}, {gpus}
    (comma-separated indices) and {leader} (shard 0's "host:port" for a replica of several
    shards, empty otherwise); the catalog's args are appended. Ready when /health answers.
    The engine's key is in its environment as MODELFLEET_ENGINE_KEY: requests come with it.
    """

    name = "command"
    adapter_api: AdapterApi | None = None

    def launch(self, start: Start) -> Launch:
        shard = start.shard
        template = shard.command or ""
        fields = {
            "model": shard.model,
            "source": shard.source,
            "host": start.host,
            "port": start.port,
            "rank": shard.rank,
            "num_shards": shard.num_shards,
            "gpus": ",".join(str(g) for g in shard.gpus),
            "leader": start.leader or "",
        }
        try:
            argv = [part.format(**fields) for part in shlex.split(template)]
        except (KeyError, IndexError, ValueError) as exc:
            raise NoDriver(f"command template {template!r} cannot be filled in: {exc}") from exc
        return Launch(argv + list(shard.args), {**gpu_env(shard), ENGINE_KEY_ENV: start.key})
