"""The router's routing table (models, their ready endpoints, how each is routed) and its keys.

The table is replaced whole by each pushed snapshot and never edited in place, so a request
that took the table once sees one consistent version to the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from modelfleet.apikeys import hash_key
from modelfleet.wire import RoutedModel, RoutingSnapshot


@dataclass(frozen=True)
class ApiKey:
    """A client credential, known to the router only by its SHA-256."""

    name: str
    sha256: str
    models: frozenset[str] | None = None  # the models it may use; None: all

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyRing:
    """The API keys the router accepts, looked up by hash: one dict lookup per request."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_hash = {k.sha256: k for k in keys}

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer KEY` header carries, or None when it is not ours."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._by_hash.get(hash_key(authorization[7:].strip()))


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

    @classmethod
    def from_snapshot(cls, snapshot: RoutingSnapshot) -> RoutingTable:
        models = {m.name: tuple(m.endpoints) for m in snapshot.models}
        keys = {e: f"Bearer {k}" for m in snapshot.models for e, k in m.keys.items()}
        replicas = {e: r for m in snapshot.models for e, r in m.replicas.items()}
        return cls(
            snapshot.version,
            snapshot.catalog_version,
            MappingProxyType(models),
            MappingProxyType({m.name: m for m in snapshot.models}),
            MappingProxyType(keys),
            MappingProxyType(replicas),
        )

    @property
    def endpoints(self) -> set[str]:
        """Every endpoint of every model."""
        return {e for endpoints in self.models.values() for e in endpoints}
