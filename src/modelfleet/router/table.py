"""The router's routing table: models, their ready endpoints, and the choice among them.

The table is replaced whole by each pushed snapshot and never edited in place, so a request
that took the table once sees one consistent version to the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from modelfleet.apikeys import hash_key
from modelfleet.wire import RoutingSnapshot


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
    """One version of what the router serves: model name -> base URLs of ready replicas."""

    version: int
    catalog_version: int
    models: Mapping[str, tuple[str, ...]]
    keys: Mapping[str, str]  # endpoint -> the `Authorization` header its engine wants

    @classmethod
    def from_snapshot(cls, snapshot: RoutingSnapshot) -> RoutingTable:
        models = {m.name: tuple(m.endpoints) for m in snapshot.models}
        keys = {e: f"Bearer {k}" for m in snapshot.models for e, k in m.keys.items()}
        return cls(
            snapshot.version,
            snapshot.catalog_version,
            MappingProxyType(models),
            MappingProxyType(keys),
        )


class Balancer:
    """Least-in-flight choice among a model's endpoints, counted by this router.

    Ties go round-robin, so an idle fleet still spreads its requests.
    """

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self._turn = 0

    def order(self, endpoints: tuple[str, ...]) -> list[str]:
        """Endpoints in the order to try them: least loaded first."""
        self._turn += 1
        n = len(endpoints)
        rotated = [endpoints[(self._turn + i) % n] for i in range(n)]
        return sorted(rotated, key=lambda e: self.in_flight.get(e, 0))

    def begin(self, endpoint: str) -> None:
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1

    def end(self, endpoint: str) -> None:
        left = self.in_flight.get(endpoint, 1) - 1
        if left > 0:
            self.in_flight[endpoint] = left
        else:
            self.in_flight.pop(endpoint, None)
