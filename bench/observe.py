"""What an operator can see of the fleet, measured in one run on this machine.

- Traces: two engine simulators and a dead replica behind a router, all sending spans by
  OTLP to a collector of the bench's own (`modelfleet.http.otlp.SpanCollector`); `--requests`
  requests through the `openai` client, half streamed, some meeting the dead replica first
  and retried: `trace_complete_ratio` is the share of the router's request spans whose tree
  is whole (`tracing.incomplete_traces`: every attempt, and under each attempt an engine
  answered, that engine's span, one trace id). Target 1.0.
- The cost of tracing on the router's hot path: zero-latency simulators reached directly,
  through the router as it was before tracing (`--baseline`, a commit, run from a copy of
  its `src` made by `git archive`), through today's router with no exporter, and with an
  OTLP exporter, in turns (bench/router.py's open loop, non-streamed, `--rate` requests/s).
  `router_overhead_added_p50_ms_with_tracing`: today's p50 minus the baseline's, no
  exporter (target <= 0.05 ms); `..._exporter`: with an exporter minus without. The same
  from each router's own overhead metric (its time per request less its waits for the
  engine, mean), which noise on the engines' side does not blur:
  `router_own_mean_ms_added_with_tracing`, `router_own_mean_ms_exporter_added`.
- What is shown is true, on a fleet as `up` starts one with router `workers: 2`:
  `counter_decreases` (samples of counters and histograms lower than in an earlier scrape of
  the router's `/metrics`, on its push API, while clients send and one worker is killed -9;
  target 0),
  `refusals_in_latency` (requests in the request-time histogram beyond those sent to an
  engine, while refused ones, a bad key and an unknown model, are mixed in; target 0), and
  `ejected_shown_ready` (a replica whose engine is stopped with SIGSTOP, once a router has it
  out of rotation, shown `ready`; target false) with `ejected_return_event` (its return
  evented once SIGCONT), and `ejected_shown_ready_any_page` (the same replica counted
  serving on the dashboard's overview, or shown ready on its node's, model's or own page,
  each rendered once before its engine stopped; target false).
- `plotted_rate_error`: a fleet as `up` starts one, a point every second; clients send
  steady requests for `--rate-load` seconds, each noting when its answer came; the model
  page's requests/s of the last hour (points of 20 s, the first from the step of the first
  request, the last still filling) against the clients' own count over the time each point
  covers: the worst relative error of a point of 20 requests or more (target <= 0.1), with
  `plotted_rates` (each point, plotted and counted).
- `events_per_fault`: every fault of bench/faults.py leaves the events naming its cause
  (run here unless `--skip-faults`; about three minutes).
- `previous_logs_kept`: a fleet as `up` starts one; an engine killed six times (each time
  its agent starts it again); `GET /v1/logs/REPLICA?previous=K` for K = 1..5 each answers
  that run's output (its first line). Target 5; K = 6 is gone (`previous_logs_sixth_gone`).
- The dashboard, in Debian's Chromium through Playwright: `ui_requests_per_load` (requests a
  page load makes besides its event stream; target <= 5), `ui_change_visible_s` (a cordon
  made through the admin API until the open overview shows it, worst of 5; target <= 1),
  and `ui_overview_ms_1000_nodes` (a control plane in this process with 1,000 nodes of 8
  GPUs and 2,000 replicas, in a process of its own: sign-in done, navigation to the
  overview until its load event with every node's row there, median of 3; target <= 1000),
  with the server's own render time of the overview's part, from nothing rendered before
  (`ui_overview_render_ms`; the dashboard keeps what it rendered while nothing changes).

It ends with one JSON line.

    python bench/observe.py [--requests 200] [--rate 200] [--duration 20] [--rate-load 50]
                             [--only-truth] [--only-rates] [--skip-faults]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import html
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import router as bench_router
import uvicorn
import yaml
from kit import end_on_sigterm, json_line, state_dir, wait
from playwright.sync_api import Browser, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.dashboard import Dashboard
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.series import RANGES, shown_width
from modelfleet.controlplane.service import create_apps
from modelfleet.http.otlp import SpanCollector
from modelfleet.http.serving import Listener
from modelfleet.http.tracing import incomplete_traces
from modelfleet.messages.wire import AgentReport
from modelfleet.security.pki import CertificateAuthority
from modelfleet.store.sqlite import SqliteStore
from modelfleet.up import FleetOptions, RunningFleet, start_fleet

HERE = Path(__file__).resolve().parent
BASELINE = "f4fabd5"  # the last commit before the router carried trace context
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# -- traces and their cost ----------------------------------------------------------------


def traces(tmp: Path, requests: int) -> dict[str, Any]:
    procs = bench_router.Processes(tmp)
    collector = SpanCollector()
    url = collector.start()
    try:
        engines = bench_router.start_sims(procs, 2, "--otlp-endpoint", url, "--itl", "0.001")
        target = bench_router.start_modelfleet(
            procs, [*engines, closed_port()], name="traced", otlp_endpoint=url, retries=2
        )
        client = openai.OpenAI(
            base_url=f"{target.urls[0]}/v1", api_key=bench_router.KEY, max_retries=0
        )
        for i in range(requests):
            if i % 2:
                stream = client.chat.completions.create(
                    model=bench_router.MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=4, stream=True,
                )  # fmt: skip
                for _ in stream:
                    pass
            else:
                client.completions.create(model=bench_router.MODEL, prompt=f"x {i}", max_tokens=4)

        def request_spans() -> list[Any] | None:
            got = [s for s in collector.taken() if "modelfleet.attempts" in s.attributes]
            return got if len(got) >= requests else None

        wait(f"the router's spans of {requests} requests", request_spans, 30)
        time.sleep(2)  # the engines' batches, sent each second
        spans = collector.taken()
        routed = [s for s in spans if "modelfleet.attempts" in s.attributes]
        broken = incomplete_traces(spans)
        retried = sum(1 for s in routed if int(s.attributes["modelfleet.attempts"]) > 1)
        for why in list(broken.values())[:5]:
            say(f"  incomplete: {why}")
        return {
            "trace_complete_ratio": round(1 - len(broken) / len(routed), 4),
            "traced_requests": len(routed),
            "traced_retried": retried,
        }
    finally:
        procs.stop_all()
        collector.stop()


def baseline_src(tmp: Path, rev: str) -> Path | None:
    """A copy of `rev`'s src, from git; None when this is no git checkout of it."""
    out = tmp / "baseline"
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", rev, "src"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        say(f"  no baseline: git archive {rev}: {archive.stderr.decode().strip()}")
        return None
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "src"


def tracing_cost(tmp: Path, rev: str, rate: float, duration: float) -> dict[str, Any]:
    procs = bench_router.Processes(tmp)
    collector = SpanCollector()
    url = collector.start()
    try:
        engines = bench_router.start_sims(procs, 2)
        targets = [bench_router.Target("direct", engines)]
        src = baseline_src(tmp, rev)
        if src is not None:
            env = {"PYTHONPATH": str(src)}
            targets.append(bench_router.start_modelfleet(procs, engines, name="before", env=env))
        targets.append(bench_router.start_modelfleet(procs, engines, name="now"))
        targets.append(
            bench_router.start_modelfleet(procs, engines, name="exporter", otlp_endpoint=url)
        )
        got = bench_router.open_loop_interleaved(targets, rate, duration, False, rounds=10)
        for name, figures in got.items():
            bench_router._say(name, f"open_{rate:g}", figures)
        p50 = {name: figures["p50_ms"] for name, figures in got.items()}
        # The router's own time per request (its overhead metric: arrival to end, less the
        # waits for the engine), which the engine's side of the wire does not blur.
        own = {t.name: own_ms(t) for t in targets if t.name != "direct"}
        say(f"  router's own time per request, mean ms: {own}")
        out: dict[str, Any] = {
            "router_overhead_added_p50_ms_exporter": round(p50["exporter"] - p50["now"], 4),
            "router_added_p50_ms_now": round(p50["now"] - p50["direct"], 4),
            "router_own_mean_ms_exporter_added": round(own["exporter"] - own["now"], 4),
        }
        if "before" in p50:
            out["router_overhead_added_p50_ms_with_tracing"] = round(p50["now"] - p50["before"], 4)
            out["router_own_mean_ms_added_with_tracing"] = round(own["now"] - own["before"], 4)
        return out
    finally:
        procs.stop_all()
        collector.stop()


def own_ms(router: bench_router.Target) -> float:
    """A router's own time per request so far, mean, in ms, from its metrics."""
    total = count = 0.0
    assert router.metrics is not None
    auth = {"authorization": f"Bearer {bench_router.PUSH_TOKEN}"}
    for line in httpx.get(router.metrics, headers=auth, timeout=10).text.splitlines():
        if line.startswith("modelfleet_router_overhead_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("modelfleet_router_overhead_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total / count * 1000 if count else float("nan")


# -- a fleet: logs of runs before, and the dashboard --------------------------------------


@contextmanager
def fleet(tmp: Path) -> Iterator[RunningFleet]:
    # Restarts after 0.2 s, and a replica kept on its node through the bench's six kills
    # in a row (by default it would be placed anew elsewhere after three).
    options = FleetOptions(
        report_interval=0.5,
        agent_args=("--backoff-base", "0.2", "--backoff-max", "1"),
        control_plane={"max_failures": 10},
    )
    running = start_fleet(tmp / "state", options)
    try:
        yield running
    finally:
        running.fleet.stop()


def samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a scrape that may only grow, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        if family.type in ("counter", "histogram")
        for s in family.samples
        if not s.name.endswith("_created")
    }


def truth(tmp: Path) -> dict[str, Any]:
    """Counters, refusals and ejections as the fleet shows them, against what was done."""
    options = FleetOptions(report_interval=0.5, router={"workers": 2})
    running = start_fleet(tmp / "state", options)
    try:
        api = admin(running)

        def ready() -> list[dict[str, Any]]:
            found = api.get("/v1/replicas").json()["replicas"]
            return [r for r in found if r["model"] == "sim-chat" and r["state"] == "ready"]

        wait("sim-chat's two replicas ready", lambda: len(ready()) == 2)
        stop = threading.Event()
        body = {"model": "sim-chat", "prompt": "x", "max_tokens": 2}

        def load() -> None:
            good = {"authorization": f"Bearer {running.api_key}", "connection": "close"}
            bad = {"authorization": "Bearer sk-nobody", "connection": "close"}
            for turn in itertools.count():
                if stop.is_set():
                    return
                headers, ask = good, body
                if turn % 3 == 1:
                    headers = bad
                elif turn % 3 == 2:
                    ask = {**body, "model": "no-such-model"}
                with contextlib.suppress(httpx.HTTPError):  # a connection to the killed worker
                    httpx.post(f"{running.router_url}/v1/completions", json=ask,
                               headers=headers, timeout=5)  # fmt: skip

        loaders = [threading.Thread(target=load) for _ in range(4)]
        for t in loaders:
            t.start()
        shown: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        decreases = 0
        push_auth = {"authorization": f"Bearer {running.admin_token}"}

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            nonlocal decreases
            page = httpx.get(f"{running.push_url}/metrics", headers=push_auth, timeout=5)
            now = samples(page.text)
            decreases += sum(1 for k, v in shown.items() if now.get(k, 0.0) < v)
            shown.update(now)
            return now

        [router] = [c.proc.pid for c in running.fleet.children if c.role == "router"]
        for i in range(60):
            scrape()
            if i == 20:
                os.kill(psutil.Process(router).children()[0].pid, signal.SIGKILL)
            time.sleep(0.1)
        stop.set()
        for t in loaders:
            t.join()
        last = scrape()
        timed = sum(
            v for (n, _), v in last.items() if n == "modelfleet_router_request_seconds_count"
        )
        answered = sum(
            v for (n, labels), v in last.items()
            if n == "modelfleet_router_requests_total" and ("status", "200") in labels
        )  # fmt: skip

        # A replica out of rotation: its engine stopped, not dead.
        victim = ready()[0]
        ui = dashboard_session(running)
        pages = replica_pages(victim)
        for path in pages.values():  # rendered, and kept, while it serves
            ui.get(path).raise_for_status()
        engine = psutil.Process(victim["shards"][0]["pid"])
        engine.suspend()
        try:

            def out() -> dict[str, Any] | None:
                found = api.get(f"/v1/replicas/{victim['id']}").json()
                return found if found["ejected"] else None

            seen = wait("a router to have the stopped replica out of rotation", out, 60)
            shown_ready = [what for what, path in pages.items()
                           if shows_ready(ui.get(path).text, what, victim["id"])]  # fmt: skip
        finally:
            engine.resume()

        def returned() -> bool:
            events = api.get("/v1/events", params={"for": f"replica/{victim['id']}"}).json()
            return any(e["reason"] == "ReplicaReturned" for e in events["events"])

        back = bool(wait("its return evented", returned, 60))
    finally:
        running.fleet.stop()
    return {
        "counter_decreases": decreases,
        "refusals_in_latency": int(timed - answered),
        "requests_timed": int(timed),
        "ejected_shown_ready": seen["state"] == "ready",
        "ejected_state": seen["state"],
        "ejected_shown_ready_any_page": bool(shown_ready),
        "ejected_shown_ready_on": shown_ready,
        "ejected_return_event": back,
    }


def dashboard_session(running: RunningFleet) -> httpx.Client:
    """A client of the dashboard, signed in (its session cookie)."""
    ui = httpx.Client(base_url=running.admin_url, timeout=20, follow_redirects=True)
    ui.post("/ui/login", data={"token": running.admin_token}).raise_for_status()
    return ui


def replica_pages(replica: dict[str, Any]) -> dict[str, str]:
    """The dashboard's pages that show `replica`, by what they are."""
    return {
        "overview": "/ui/",
        "node": f"/ui/nodes/{replica['shards'][0]['node']}",
        "model": f"/ui/models/{replica['model']}",
        "replica": f"/ui/replicas/{replica['id']}",
    }


def shows_ready(page: str, what: str, rid: str) -> bool:
    """Whether a page (of `replica_pages`) shows replica `rid`, of sim-chat's two, serving:
    the overview counting both serving, another page's row of it (its own page: its state)
    saying `ready`."""
    if what == "overview":
        row = re.search(r'/ui/models/sim-chat">sim-chat</a></td>.*?class="serving">(\d+)<',
                        page, re.S)  # fmt: skip
        return row is None or row.group(1) != "1"
    found = re.search(rf'data-replica="{rid}">.*?</tr>' if what != "replica" else
                      r"<h1>Replica .*?</p>", page, re.S)  # fmt: skip
    return found is None or "out-of-rotation" not in found.group(0)


def plotted_rates(tmp: Path, seconds: float) -> dict[str, Any]:
    """The model page's requests/s against the clients' own count (see the docstring)."""
    step = 1
    width = shown_width(RANGES["1h"], step)
    options = FleetOptions(report_interval=0.5, control_plane={"series_interval": step})
    running = start_fleet(tmp / "state", options)
    answered: list[float] = []  # when each answer came (wall clock)
    try:
        api = admin(running)
        wait("sim-chat serving", lambda: len([
            r for r in api.get("/v1/replicas").json()["replicas"]
            if r["model"] == "sim-chat" and r["state"] == "ready"]) == 2)  # fmt: skip
        body = {"model": "sim-chat", "prompt": "count me", "max_tokens": 4}
        headers = {"authorization": f"Bearer {running.api_key}"}
        began = time.time()
        end = began + seconds

        def load() -> None:
            with httpx.Client(timeout=30) as client:
                while time.time() < end:
                    got = client.post(f"{running.router_url}/v1/completions", json=body,
                                      headers=headers)  # fmt: skip
                    if got.status_code == 200:
                        answered.append(time.time())
                    time.sleep(0.1)

        loaders = [threading.Thread(target=load) for _ in range(3)]
        for t in loaders:
            t.start()
        for t in loaders:
            t.join()
        # Read half a step after a step's end: the points written are those up to it.
        time.sleep(step * 1.5 - time.time() % step)
        read_at = time.time()
        page = dashboard_session(running).get("/ui/models/sim-chat").text
    finally:
        running.fleet.stop()
    found = re.search(r"data-plot='([^']*)'", page)
    plot = json.loads(html.unescape(found.group(1))) if found else {"at": []}
    written_to = int(read_at // step) * step  # the end of the last step written
    # The model's first point is the step of its first request: nothing is plotted before.
    first = int(min(answered, default=read_at) // step) * step
    points, worst = [], 0.0
    for at, rate in zip(plot["at"], plot.get("requests_per_s", []), strict=False):
        start, stop = max(at - width, first), min(at, written_to)
        counted = sum(1 for t in answered if start <= t < stop)
        if rate is None or counted < 20 or stop <= start:
            continue
        truth = counted / (stop - start)
        points.append({"at": at, "plotted": rate, "counted_per_s": round(truth, 3)})
        worst = max(worst, abs(rate - truth) / truth)
    return {"plotted_rate_error": round(worst, 3) if points else None, "plotted_rates": points}


def admin(running: RunningFleet) -> httpx.Client:
    return httpx.Client(
        base_url=running.admin_url,
        headers={"authorization": f"Bearer {running.admin_token}"},
        timeout=20,
    )


def previous_logs(running: RunningFleet) -> dict[str, Any]:
    with admin(running) as api:

        def ready_replica() -> dict[str, Any] | None:
            reps = api.get("/v1/replicas").json()["replicas"]
            ready = [r for r in reps if r["model"] == "sim-chat" and r["state"] == "ready"]
            return ready[0] if ready else None

        replica = wait("a sim-chat replica ready", ready_replica)
        rid = replica["id"]
        for _ in range(6):
            pid = replica["shards"][0]["pid"]
            os.killpg(pid, signal.SIGKILL)

            def again(pid: int = pid) -> dict[str, Any] | None:
                r = api.get(f"/v1/replicas/{rid}").json()
                if "state" not in r:
                    raise RuntimeError(f"replica {rid} is gone: {r}")
                fresh = r["state"] == "ready" and r["shards"][0]["pid"] not in (None, pid)
                return r if fresh else None

            replica = wait("the engine started again", again, 120)
        kept = 0
        for k in range(1, 6):
            got = api.get(f"/v1/logs/{rid}", params={"previous": k, "tail": 50})
            if got.status_code == 200 and any(
                "engine-sim: loading" in x for x in got.json()["lines"]
            ):
                kept += 1
        sixth = api.get(f"/v1/logs/{rid}", params={"previous": 6})
        return {"previous_logs_kept": kept, "previous_logs_sixth_gone": sixth.status_code == 404}


def launch(p: Any) -> Browser:
    browser: Browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    return browser


def sign_in(browser: Browser, admin_url: str, token: str) -> Any:
    page = browser.new_page()
    page.set_default_timeout(30_000)
    page.goto(f"{admin_url}/ui/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{admin_url}/ui/")
    return page


def dashboard_live(running: RunningFleet) -> dict[str, Any]:
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = sign_in(browser, running.admin_url, running.admin_token)
            asked: list[str] = []
            page.on("request", lambda r: asked.append(r.url))
            page.reload()
            page.locator("tr[data-node]").first.wait_for()
            wait("the stream opened", lambda: any("/ui/live/" in u for u in asked), 10)
            per_load = len([u for u in asked if "/ui/live/" not in u])
            seen: list[float] = []
            with admin(running) as api:
                for _ in range(5):
                    for mark, shown in (("cordoned", "cordoned"), ("none", "")):
                        began = time.monotonic()
                        api.post("/v1/nodes/node-2/mark", json={"mark": mark}).raise_for_status()
                        page.wait_for_function(
                            "shown => document.querySelector('tr[data-node=\"node-2\"] .mark')"
                            "?.textContent.trim() === shown",
                            arg=shown,
                            polling="raf",
                        )
                        seen.append(time.monotonic() - began)
            return {"ui_requests_per_load": per_load, "ui_change_visible_s": round(max(seen), 3)}
        finally:
            browser.close()


def big_control_plane(nodes: int, replicas: int) -> ControlPlane:
    """A control plane in this process that has heard from `nodes` nodes of 8 GPUs and
    placed `replicas` replicas over 20 models."""
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    models = [
        {
            "name": f"model-{i:02d}",
            "engine": "sim",
            "replicas": replicas // 20,
            "gpu_memory": "20GiB",
        }
        for i in range(20)
    ]
    keeper.apply(yaml.safe_dump({"models": models}), "api", 0.0)
    ca = CertificateAuthority.create("bench CA", datetime.datetime.now(datetime.UTC))
    config = ControlPlaneConfig(
        admin_token="bench-admin-token", settle_for=-1, state_dir=state_dir("observe")
    )
    cp = ControlPlane(config, keeper, ca=ca)
    now = time.monotonic()
    gpus = SimulatedGpus("8x80GB", {}).gpus()
    for n in range(nodes):
        report = AgentReport(
            node=f"gpu-{n:04d}", boot_id="b", seq=1, address="10.0.0.1", gpus=gpus, shards=[]
        )
        cp.state.take_report(report, keeper.current, now)
    cp.reconcile_once(now)
    return cp


def serve_big(ready: Any, stop: Any) -> None:
    """In a process of its own, as a control plane runs: a 1,000-node control plane's admin
    listener. Puts (its URL, the server's render times of the overview) on `ready`."""
    cp = big_control_plane(1000, 2000)

    async def run() -> None:
        renders = []
        for _ in range(5):
            began = time.perf_counter()
            html = await Dashboard(cp).parts.render_part("overview", "")  # a new one: nothing held
            renders.append(time.perf_counter() - began)
        assert html is not None and html.count("data-node=") == 1000
        _, app = create_apps(cp, Dashboard(cp))
        listener = Listener("admin", app)
        sock = listener.bind()
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        ready.put((listener.url, renders))
        await asyncio.to_thread(stop.wait)
        server.should_exit = True
        await task

    asyncio.run(run())


def dashboard_at_scale() -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    proc = context.Process(target=serve_big, args=(ready, stop))
    proc.start()
    try:
        url, renders = ready.get(timeout=120)
        with sync_playwright() as p:
            browser = launch(p)
            try:
                page = sign_in(browser, url, "bench-admin-token")
                loads = []
                for _ in range(3):
                    began = time.monotonic()
                    page.goto(f"{url}/ui/", wait_until="load")
                    assert page.locator("tr[data-node]").count() == 1000
                    loads.append(time.monotonic() - began)
            finally:
                browser.close()
    finally:
        stop.set()
        proc.join(30)
    return {
        "ui_overview_ms_1000_nodes": round(statistics.median(loads) * 1000, 1),
        "ui_overview_render_ms": round(statistics.median(renders) * 1000, 1),
    }


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--only-truth", action="store_true", help="the truth part alone")
    parser.add_argument("--only-rates", action="store_true", help="plotted_rate_error alone")
    parser.add_argument("--rate-load", type=float, default=50.0,
                        help="seconds of steady requests for plotted_rate_error")  # fmt: skip
    args = parser.parse_args()
    out: dict[str, Any] = {"bench": "observe"}
    if args.only_rates:
        with tempfile.TemporaryDirectory() as tmp:
            out.update(plotted_rates(Path(tmp), args.rate_load))
        json_line(out)
        return
    if args.only_truth:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "truth").mkdir()
            out.update(truth(Path(tmp) / "truth"))
            (Path(tmp) / "rates").mkdir()
            out.update(plotted_rates(Path(tmp) / "rates", args.rate_load))
        json_line(out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        say("traces ...")
        (root / "traces").mkdir()
        out.update(traces(root / "traces", args.requests))
        say(f"  {out}")
        say("the cost of tracing ...")
        (root / "cost").mkdir()
        out.update(tracing_cost(root / "cost", args.baseline, args.rate, args.duration))
        say("previous logs and the live dashboard ...")
        (root / "fleet").mkdir()
        with fleet(root / "fleet") as running:
            out.update(previous_logs(running))
            out.update(dashboard_live(running))
        say("what is shown is true ...")
        (root / "truth").mkdir()
        out.update(truth(root / "truth"))
        say("plotted rates against the clients' count ...")
        (root / "rates").mkdir()
        out.update(plotted_rates(root / "rates", args.rate_load))
        say(f"  {out}")
        say("the dashboard at 1,000 nodes ...")
        out.update(dashboard_at_scale())
    if not args.skip_faults:
        say("faults ...")
        import faults

        results = faults.run(20.0)
        out["events_per_fault"] = all(not r["events_missing"] for r in results.values())
        out["events_missing"] = {
            k: r["events_missing"] for k, r in results.items() if r["events_missing"]
        }
    json_line(out)


if __name__ == "__main__":
    main()
