"""The control plane as a process: its two listeners and its loops, until SIGINT/SIGTERM.

Two listeners on their own ports: the agent API (`agent_api.py`, agent token) and the admin
API (`admin_api/`, admin token), both around one `ControlPlane` (`plane.py`).
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette

from modelfleet.controlplane.admin_api import create_admin_app
from modelfleet.controlplane.agent_api import AgentApi, create_agent_app
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import (
    CATALOG_SEEN_FILE,
    FLEET_CA_KEY,
    PKI_DIR,
    STORE_FILE,
    ControlPlaneConfig,
)
from modelfleet.controlplane.dashboard import Dashboard
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.http import http1
from modelfleet.http.serving import Listener, run_service
from modelfleet.security.pki import (
    CA_CERT,
    CA_KEY,
    CertificateAuthority,
    PkiError,
    TlsFiles,
    client_context,
    is_wildcard,
)
from modelfleet.store import Store, StoreError
from modelfleet.store.sqlite import SqliteStore

log = logging.getLogger("modelfleet.controlplane")


# Connections each listener takes at once (fewer where the open-file limit says so): an agent
# holds one (its heartbeat waits there), an operator's dashboard or ctl a few.
AGENT_CONNECTIONS = 50_000
ADMIN_CONNECTIONS = 1_000
# Python's cyclic garbage collector scans what it tracks: with 10,000 nodes about 500,000
# objects of state and 300 ms a full collection, and heartbeats held for their interval got old
# enough to trigger one every few seconds (measured: report p99 over 1 s, a third of the
# process's CPU in the collector). Almost all that lives here a second lives long (the state,
# held heartbeats) and makes no reference cycles (a few thousand objects' worth in a
# 10,000-node bench run), so what has lived a second is frozen out of the collector's sight,
# and young objects are collected only past GC_THRESHOLDS[0] more made than freed within one
# second: a restart taking 10,000 reports makes 200,000-400,000 a second, which a collection
# every 50,000 scanned for nothing (0.6-1.4 CPU-seconds of the restart). A full collection
# (cycles that went out of use among frozen objects) runs every FULL_COLLECTION_S. The
# collector is off while the process starts (`modelfleet control-plane`): what its imports
# and its start make lives for good, and is frozen at once here.
GC_THRESHOLDS = (1_000_000, 20, 100)
FREEZE_EVERY_S = 1.0
FULL_COLLECTION_S = 600.0


async def keep_heap(
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    """Freeze what has lived a second out of the collector's sight; collect fully every
    FULL_COLLECTION_S."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()
    gc.enable()
    collected = monotonic()
    while True:
        await sleep(FREEZE_EVERY_S)
        if monotonic() - collected > FULL_COLLECTION_S:
            began = time.perf_counter()
            gc.unfreeze()
            gc.collect()
            collected = monotonic()
            log.debug("full garbage collection: %.0f ms", (time.perf_counter() - began) * 1000)
        gc.freeze()


def outlasting_the_store(
    loop: Callable[[], Coroutine[Any, Any, None]],
) -> Callable[[], Coroutine[Any, Any, None]]:
    """`loop`, begun again after a StoreError escaped it (with a backoff, said once per
    error): a store that cannot be reached or written degrades what needs it, and never
    ends the control plane (each loop handles the failures it expects; this is the net
    under them)."""

    async def outlasting() -> None:
        failures, said = 0, ""
        while True:
            try:
                await loop()
                return
            except StoreError as exc:
                failures += 1
                if str(exc) != said:
                    said = str(exc)
                    log.error("%s stopped on a store error (begun again): %s", name, exc)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))

    name = getattr(loop, "__qualname__", "a loop")
    return outlasting


def create_apps(cp: ControlPlane, dashboard: Dashboard | None = None) -> tuple[AgentApi, Starlette]:
    """The agent API app and the admin API app, with the `dashboard` at /ui when given."""
    ui = dashboard.app() if dashboard is not None else None
    return create_agent_app(cp), create_admin_app(cp, ui)


def open_catalogs(config: ControlPlaneConfig) -> CatalogKeeper:
    """The store and the catalogs it holds (nothing is applied before this control plane
    knows it leads: see `CatalogKeeper.lead`).

    Raises CatalogInvalid, StoreError or OSError when there is no catalog to start from.
    """
    store: Store
    if config.store is not None:
        # Imported here: psycopg is 0.09 s of a start that has no use for it (a restart's
        # agents wait for it to listen).
        from modelfleet.store.postgres import Bounds, PostgresStore

        store = PostgresStore(config.store, bounds=Bounds.for_lease(config.lease_ttl))
    else:
        store = SqliteStore(config.state_dir / STORE_FILE)
    keeper = CatalogKeeper(store, config.catalog, config.state_dir / CATALOG_SEEN_FILE)
    keeper.check_start()
    return keeper


async def serve(
    config: ControlPlaneConfig,
    catalogs: CatalogKeeper,
    ready_file: Path | None,
    ca: CertificateAuthority,
    tls: TlsFiles | None = None,
) -> None:
    """Run the control plane until SIGINT/SIGTERM, its listeners serving TLS with `tls` (from
    `listener_certificate`) when given. Routers' push APIs are checked against `ca`.
    Engines and agents keep running."""
    http = httpx.AsyncClient(timeout=5, verify=client_context(ca.cert_pem))
    cp = ControlPlane(config, catalogs, http=http, ca=ca)
    dashboard = Dashboard(cp)
    agent_app, admin_app = create_apps(cp, dashboard)
    ca_file = config.state_dir / PKI_DIR / CA_CERT
    ready_extra = {"ca_file": str(ca_file), "ca_fingerprint": ca.fingerprint}
    if tls is not None:
        log.info(
            "serving TLS with a certificate of this control plane's CA %s (fingerprint %s) for %s",
            ca_file,
            ca.fingerprint,
            ", ".join(config.certificate_names()),
        )
    listeners = [
        Listener("agent", agent_app, config.host, config.agent_port, tls=tls,
                 bounds=http1.Bounds(max_connections=AGENT_CONNECTIONS)),
        Listener("admin", admin_app, config.host, config.admin_port, tls=tls,
                 bounds=http1.Bounds(max_connections=ADMIN_CONNECTIONS)),
    ]  # fmt: skip
    catalog = catalogs.current
    total = sum(m.replicas for m in catalog.models)
    log.info(
        "catalog version %d: %d model(s), %d replica(s); settling up to %.0fs",
        catalog.version,
        len(catalog.models),
        total,
        cp.term.settle_for,
    )

    async def say_where() -> None:
        """Now that it listens: where agents and operators reach it, for the other control
        planes on the store to send them here when this one leads."""
        agent, admin = (advertised(config, li.url) for li in listeners)
        await cp.leadership.say_where(agent, admin, cp.calls)

    await run_service(
        listeners,
        ready_file=ready_file,
        on_ready=say_where,
        # The watch is a loop so that stopping the loops answers every held heartbeat before
        # the listeners wait for their requests to finish.
        loops=[
            *(
                outlasting_the_store(loop)
                for loop in (
                    cp.lease_loop,
                    cp.reconcile_loop,
                    cp.publisher.run,
                    cp.catalog_file.run,
                    cp.usage.run,
                    cp.recorder.run,
                    cp.loads.run,
                    cp.autoscale_loop,
                    lambda: cp.events.run(cp.calls.background),
                )
            ),
            cp.watch.run,
            dashboard.run,
            keep_heap,
        ],
        on_stop=cp.close,
        ready_extra=ready_extra,
    )


def advertised(config: ControlPlaneConfig, url: str) -> str:
    """A listener's URL as others reach it: a wildcard host is replaced by the first name of
    the control plane's certificate (which the config requires when it serves TLS)."""
    if not is_wildcard(config.host):
        return url
    names = config.certificate_names()
    name = names[0] if names else socket.gethostname()
    port = url.rsplit(":", 1)[1]
    scheme = url.split("://", 1)[0]
    return f"{scheme}://{f'[{name}]' if ':' in name else name}:{port}"


def fleet_ca(config: ControlPlaneConfig, store: Store) -> CertificateAuthority:
    """The fleet's CA: kept in the store, so that every control plane on it signs and is
    trusted alike, and in the state dir (`pki/`, whose `ca.crt` clients are given). The first
    control plane on a store puts its own there (made at its first start, or the one an older
    state dir holds); the others take it. A state dir whose CA is another than the store's is
    refused: machines trusting one would be cut off by the other. Raises PkiError,
    StoreError or OSError."""
    folder = config.state_dir / PKI_DIR
    had = (folder / CA_CERT).exists() or (folder / CA_KEY).exists()
    local = CertificateAuthority.load_or_create(
        folder, "modelfleet control plane CA", datetime.datetime.now(datetime.UTC)
    )
    offered = json.dumps({"cert": local.cert_pem.decode(), "key": local.key_pem.decode()})
    kept = json.loads(store.put_meta_once(FLEET_CA_KEY, offered))
    shared = CertificateAuthority.from_pem(kept["cert"].encode(), kept["key"].encode())
    if shared.fingerprint == local.fingerprint:
        return local
    if had:
        raise PkiError(
            f"the CA in {folder} (fingerprint {local.fingerprint}) is not the fleet's CA in the "
            f"store {store.where} (fingerprint {shared.fingerprint}): machines that trust one "
            f"would not trust the other. To run this control plane on this store, move {folder} "
            "away (what trusts its CA must then be given the store's); or give it a store of "
            "its own"
        )
    shared.write(folder)  # made just now, and another was first: the store's is the fleet's
    log.info("took the fleet's CA from the store (fingerprint %s)", shared.fingerprint)
    return shared


def listener_certificate(config: ControlPlaneConfig, ca: CertificateAuthority) -> TlsFiles:
    """A certificate of `ca` for the control plane's listeners, issued anew at each start
    for the names the config gives: every client trusts the CA, so a new certificate needs
    nothing of them. Raises OSError."""
    now = datetime.datetime.now(datetime.UTC)
    issued = ca.issue(config.certificate_names(), now)
    return issued.write(config.state_dir / PKI_DIR, "control-plane")
