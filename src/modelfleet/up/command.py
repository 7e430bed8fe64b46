"""`modelfleet up`: bring the fleet up, print how to use it, keep it up, stop it all."""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from modelfleet.core.catalog import Catalog
from modelfleet.host.files import write_json_atomic
from modelfleet.host.statedir import StateDirLock
from modelfleet.up.children import stop_leftovers
from modelfleet.up.configs import GPUS_PER_NODE, NODES, FleetOptions, one_machine
from modelfleet.up.fleet import start_fleet, wait_serving
from modelfleet.up.restarts import Restarts


def up(
    state_dir: Path,
    router_port: int = 0,
    serve_timeout: float = 15.0,
    limits_store: str | None = None,
    redis: bool | None = None,
    gpus: str = GPUS_PER_NODE,
    control_planes: int = 1,
    store: str | None = None,
) -> int:
    """Bring the fleet up, print how to use it, and stop it all on SIGINT/SIGTERM. `gpus`:
    each node's simulated GPUs, or REAL_GPUS or CPU_SLOTS... for this machine's own, as one
    node."""
    state_dir = state_dir.resolve()
    lock = StateDirLock(state_dir, "modelfleet up").acquire()  # StateDirBusy names the holder
    left = stop_leftovers(state_dir)
    if left.stopped:
        print(
            f"an earlier `modelfleet up` on {state_dir} is gone but left "
            f"{', '.join(left.stopped)} running: stopped them; their engines are adopted by "
            "the new agents",
            flush=True,
        )
    catalog_file = state_dir / "catalog.yaml"
    if catalog_file.exists():  # refuse a broken file before starting anything
        Catalog.from_yaml(catalog_file.read_text(), source=str(catalog_file))

    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    shape: dict[str, Any] = {"gpus": gpus}
    if one_machine(gpus):
        shape["nodes"] = NODES[:1]  # one machine's GPUs (or cores) are one node's
    options = FleetOptions(
        router_port=router_port,
        limits_store=limits_store,
        redis=redis,
        control_planes=control_planes,
        store=store,
        **shape,
    )
    fleet = start_fleet(state_dir, options, left)
    try:
        catalog = Catalog.from_yaml(catalog_file.read_text(), source=str(catalog_file))
        serving = wait_serving(fleet.push_url, fleet.admin_token, catalog, serve_timeout)
        info = fleet.info()
        write_json_atomic(state_dir / "up.json", info)
        for note in fleet.notes:
            print(f"note: {note}", flush=True)
        _print_summary(info, catalog, state_dir, serving)

        keeper = Restarts()
        while not stopping:
            if keeper.tend(fleet, lambda: stopping, time.monotonic()):
                write_json_atomic(state_dir / "up.json", fleet.info())
            time.sleep(0.2)
    finally:
        print("stopping the fleet ...", flush=True)
        fleet.fleet.stop()
        (state_dir / "up.json").unlink(missing_ok=True)
    lock.release()
    print("stopped.", flush=True)
    return 0


def _print_summary(info: dict[str, Any], catalog: Catalog, state_dir: Path, serving: bool) -> None:
    first = catalog.models[0].name if catalog.models else "MODEL"
    body = json.dumps({"model": first, "messages": [{"role": "user", "content": "Hello!"}]})
    models = ", ".join(
        f"{m.name} ({m.replicas} replica{'s' if m.replicas > 1 else ''})" for m in catalog.models
    )
    lines = [
        f"modelfleet is up  (state: {state_dir})",
        f"  router url:  {info['router_url']}   OpenAI-compatible, send the API key",
        f"  admin url:   {info['admin_url']}   token: {info['admin_token']}",
        f"  dashboard:   {info['admin_url']}/ui/   sign in with the admin token",
        f"  api key:     {info['api_key']}",
        f"  models:      {models}",
    ]
    if len(info.get("admin_urls", [])) > 1:
        lines.insert(
            3, f"  control planes: {', '.join(info['admin_urls'])}  store: {info['store']}"
        )
    # The ctl commands printed work as printed, from this folder, whatever the state dir.
    ctl = "modelfleet ctl"
    if state_dir != Path(".modelfleet"):
        ctl += f" --state-dir {shlex.quote(str(state_dir))}"
    if not serving:
        lines.append(f"  warning: not every replica serves yet; `{ctl} replicas` says why")
    lines += [
        "",
        "Try it:",
        f"  curl -s {info['router_url']}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {info['api_key']}' -H 'Content-Type: application/json' \\",
        f"    -d '{body}'",
        "",
        f"  {ctl} nodes",
        f"  {ctl} replicas",
        "",
        f"Everything above is also in {state_dir / 'up.json'}. Ctrl-C stops the whole fleet.",
    ]
    print("\n".join(lines), flush=True)
