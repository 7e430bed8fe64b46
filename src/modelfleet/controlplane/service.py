"""The control plane as a process: its two listeners and its loops, until SIGINT/SIGTERM.

Two listeners on their own ports: the agent API (`agent_api.py`, agent token) and the admin
API (`admin_api.py`, admin token), both around one `ControlPlane` (`plane.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.applications import Starlette

from modelfleet.clock import SYSTEM_CLOCK
from modelfleet.controlplane.admin_api import create_admin_app
from modelfleet.controlplane.agent_api import create_agent_app
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import STORE_FILE, ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.serving import Listener, run_service
from modelfleet.store.sqlite import SqliteStore

log = logging.getLogger("modelfleet.controlplane")


def create_apps(cp: ControlPlane) -> tuple[Starlette, Starlette]:
    """The agent API app and the admin API app."""
    return create_agent_app(cp), create_admin_app(cp)


def open_catalogs(config: ControlPlaneConfig) -> CatalogKeeper:
    """The store in the state dir and the catalog to start from (see `CatalogKeeper.start`).

    Raises CatalogInvalid, StoreError or OSError when there is no catalog to start from.
    """
    store = SqliteStore(config.state_dir / STORE_FILE)
    keeper = CatalogKeeper(store, config.catalog)
    keeper.start(SYSTEM_CLOCK.time())
    return keeper


async def serve(
    config: ControlPlaneConfig, catalogs: CatalogKeeper, ready_file: Path | None
) -> None:
    """Run the control plane until SIGINT/SIGTERM. Engines and agents keep running."""
    cp = ControlPlane(config, catalogs)
    agent_app, admin_app = create_apps(cp)
    listeners = [
        Listener("agent", agent_app, config.host, config.agent_port),
        Listener("admin", admin_app, config.host, config.admin_port),
    ]
    catalog = catalogs.current
    total = sum(m.replicas for m in catalog.models)
    log.info(
        "catalog version %d: %d model(s), %d replica(s); settling up to %.0fs",
        catalog.version,
        len(catalog.models),
        total,
        cp.settle_for,
    )
    await run_service(
        listeners,
        ready_file=ready_file,
        loops=[cp.reconcile_loop, cp.publisher.run, cp.catalog_loop, cp.usage.run],
        on_stop=cp.close,
    )
