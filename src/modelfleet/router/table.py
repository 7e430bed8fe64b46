"""The router's routing table (models, their ready endpoints, how each is routed) and its keys.

The table is replaced whole by each pushed snapshot and never edited in place, so a request
that took the table once sees one consistent version to the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from modelfleet.messages.wire import RoutedKey, RoutedModel, RoutingSnapshot
from modelfleet.security.apikeys import hash_key


@dataclass(frozen=True)
class ApiKey:
    """A client credential, known to the router only by its SHA-256, and its limits."""

    name: str
    sha256: str
    models: frozenset[str] | None = None  # the models it may use; None: all
    rpm: int | None = None  # requests per minute; None: no limit
    tpm: int | None = None  # tokens per minute, prompt and completion
    max_concurrent: int | None = None
    expires_at: float | None = None  # wall-clock seconds

    @classmethod
    def routed(cls, key: RoutedKey) -> ApiKey:
        """A key the control plane pushed."""
        models = frozenset(key.models) if key.models is not None else None
        return cls(
            key.name, key.sha256, models, key.rpm, key.tpm, key.max_concurrent, key.expires_at
        )

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def expired(self, now: float) -> bool:
        """Whether the key has expired at wall time `now`."""
        return self.expires_at is not None and now >= self.expires_at


NO_KEY = "Missing or incorrect API key: send 'Authorization: Bearer <key>'."


class KeyRing:
    """The API keys the router accepts, looked up by hash: one dict lookup per request."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_hash = {k.sha256: k for k in keys}
        # Headers already found to carry one of the keys: a hash per request was 2 % of the
        # router's CPU. Only known keys are kept, so a client sending random keys cannot
        # grow it; it lives as long as this ring, which a pushed table replaces.
        self._known: dict[str, ApiKey] = {}
        self._known_max = 2 * len(keys) + 64

    def check(self, authorization: str | None, now: float) -> ApiKey | str:
        """The key an `Authorization: Bearer KEY` header carries, or why it is refused (not
        ours, or expired at wall time `now`)."""
        if authorization is None:
            return NO_KEY
        key = self._known.get(authorization)
        if key is None:
            if not authorization.startswith("Bearer "):
                return NO_KEY
            key = self._by_hash.get(hash_key(authorization[7:].strip()))
            if key is None:
                return NO_KEY
            if len(self._known) >= self._known_max:
                self._known.clear()
            self._known[authorization] = key
        if key.expired(now):
            return f"This API key ({key.name}) has expired; ask for a new one."
        return key


@dataclass(frozen=True)
class RoutingTable:
    """One version of what the router serves: model name -> base URLs of ready replicas, with
    how each model is routed."""

    version: int
    catalog_version: int
    models: Mapping[str, tuple[str, ...]]
    routes: Mapping[str, RoutedModel]  # model -> its routing fields
    keys: Mapping[str, str]  # endpoint -> the `Authorization` header its engine wants
    replicas: Mapping[str, str]  # endpoint -> the id of the replica it serves
    # A LoRA adapter is routed as a model of its own (its endpoints: the replicas of its base
    # holding it loaded): adapter -> its base model.
    parents: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_snapshot(cls, snapshot: RoutingSnapshot) -> RoutingTable:
        models = {m.name: tuple(m.endpoints) for m in snapshot.models}
        routes = {m.name: m for m in snapshot.models}
        keys = {e: f"Bearer {k}" for m in snapshot.models for e, k in m.keys.items()}
        replicas = {e: r for m in snapshot.models for e, r in m.replicas.items()}
        parents = {}
        for base in snapshot.models:
            for adapter, holders in base.adapters.items():
                if adapter in routes:
                    continue  # the control plane's catalog refuses this; a name means one thing
                parents[adapter] = base.name
                models[adapter] = tuple(holders)
                routes[adapter] = adapter_route(base, adapter, holders)
        return cls(
            snapshot.version,
            snapshot.catalog_version,
            MappingProxyType(models),
            MappingProxyType(routes),
            MappingProxyType(keys),
            MappingProxyType(replicas),
            MappingProxyType(parents),
        )

    def adapter_alias(self, model: str) -> str | None:
        """The adapter `model` names as "base:adapter", if it is one of base's."""
        base, sep, adapter = model.rpartition(":")
        if sep and self.parents.get(adapter) == base:
            return adapter
        return None

    @property
    def endpoints(self) -> set[str]:
        """Every endpoint of every model."""
        return {e for endpoints in self.models.values() for e in endpoints}


def adapter_route(base: RoutedModel, adapter: str, holders: list[str]) -> RoutedModel:
    """How requests for `adapter` of `base` are routed: to the replicas holding it, by load,
    as `base`'s are. While none holds it, its requests are held (`cold.py`) until the control
    plane has had it loaded, and then released at most `base`'s target per replica (a base of
    fixed count has none: up to its cold queue each)."""
    return base.model_copy(
        update={
            "name": adapter,
            "endpoints": list(holders),
            "keys": {},
            "replicas": {},
            "adapters": {},
            "adapter_errors": {},
            "target_in_flight": base.target_in_flight or float(base.cold_queue),
            "replicas_wanted": None,
        }
    )
