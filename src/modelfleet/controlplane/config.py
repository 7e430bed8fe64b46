"""The control plane's config file."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class RouterTarget(BaseModel):
    """A router the control plane pushes routing snapshots to."""

    model_config = ConfigDict(extra="forbid")
    url: str  # the router's push listener, e.g. http://127.0.0.1:8081
    token: str  # the router's push_token


class ControlPlaneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    catalog: Path  # the catalog file; a relative path is read from the config file's folder
    host: str = "127.0.0.1"
    agent_port: int = Field(default=7070, ge=0, le=65535)
    admin_port: int = Field(default=7071, ge=0, le=65535)
    admin_token: str = Field(min_length=8)
    agent_token: str | None = None  # None: agents need no token (development only)
    routers: list[RouterTarget] = Field(default_factory=list)
    known_nodes: list[str] = Field(default_factory=list)  # settling ends once all have reported
    settle_for: float = 0.0  # negative: no window; zero: the default; positive: that long
    reconcile_interval: float = Field(default=1.0, gt=0)
    node_stale_after: float = Field(default=10.0, gt=0)
    push_interval: float = Field(default=10.0, gt=0)
    max_report_bytes: int = Field(default=1 << 20, gt=0)


DEFAULT_SETTLE_FOR_S = 10.0
