"""The router as a real process in front of real engine simulators: the openai client
streaming through it, a replica killed mid-run, a huge body refused unread."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Procs, wait_for, wait_json
from .test_processes import KEY, PUSH_TOKEN, router_metrics, start_engine, start_router


def engine_of(procs: Procs, tmp: Path, model: str, name: str) -> tuple[str, int]:
    """An engine simulator of `model`, known to the test as `name` (its ready file and log)."""
    ready = tmp / f"engine-{name}.json"
    proc = procs.start(
        "engine-sim", "--model", model, "--port", "0", "--itl", "0.02",
        "--ready-file", str(ready), log=name,
    )  # fmt: skip
    return wait_json(ready, proc)["urls"]["engine"], proc.pid


def counter(page: str, line_start: str) -> float:
    """The value of the first metric line of `page` that starts with `line_start`; 0 if none."""
    for line in page.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_openai_client_streams_through_the_router_which_names_the_replica(
    procs: Procs, tmp_path: Path
) -> None:
    engine, _ = start_engine(procs, tmp_path, "m", "--itl", "0.005")
    router = start_router(
        procs, tmp_path, [{"name": "m", "endpoints": [engine]}], push_token=PUSH_TOKEN
    )
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=KEY, timeout=20, max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert len("".join(pieces).split()) == 6
    raw = client.completions.with_raw_response.create(model="m", prompt="x", max_tokens=2)
    assert raw.headers["x-modelfleet-replica"] == engine  # a static config names no replica ids
    assert raw.parse().usage.completion_tokens == 2
    page = router_metrics(tmp_path)
    assert counter(page, 'modelfleet_router_requests_total{model="m",status="200"}') == 2
    assert counter(page, "modelfleet_router_overhead_seconds_count") == 2


def test_a_replica_killed_mid_run_fails_no_request(procs: Procs, tmp_path: Path) -> None:
    """Requests in flight at the killed engine, and those that meet its closed port after, go
    to the other replica before the client has seen a byte: not one fails."""
    doomed, doomed_pid = engine_of(procs, tmp_path, "m", "doomed")
    survivor, _ = engine_of(procs, tmp_path, "m", "survivor")
    assert doomed != survivor
    router = start_router(
        procs, tmp_path, [{"name": "m", "endpoints": [doomed, survivor]}], push_token=PUSH_TOKEN
    )
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                body = {"model": "m", "prompt": "x", "max_tokens": 10}
                try:
                    r = http.post(f"{router}/v1/completions", json=body)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                answered[0] += 1

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        wait_for("40 requests answered before the kill", lambda: answered[0] >= 40, timeout=60)
        engine = psutil.Process(doomed_pid)
        assert engine.status() != psutil.STATUS_ZOMBIE
        engine.send_signal(signal.SIGKILL)
        killed_at = answered[0]
        wait_for("80 answers after the kill", lambda: answered[0] >= killed_at + 80, timeout=60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=40)
    assert failures == []
    page = router_metrics(tmp_path)
    assert counter(page, 'modelfleet_router_retries_total{model="m"}') >= 1
    assert counter(page, f'modelfleet_router_ejections_total{{endpoint="{doomed}"}}') == 1


def test_a_huge_body_is_refused_before_it_is_read(procs: Procs, tmp_path: Path) -> None:
    """A client that declares 200 MiB gets 413 after sending 1 MiB: the router neither waits
    for nor keeps the rest."""
    router = start_router(procs, tmp_path, [{"name": "m", "endpoints": []}])
    pid = procs.started[-1].pid
    port = int(router.rsplit(":", 1)[1])
    before = psutil.Process(pid).memory_info().rss
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {200 << 20}\r\n\r\n"
        )
        sock.sendall(head.encode())
        with contextlib.suppress(OSError):  # it may close before taking it all: the point
            sock.sendall(b"x" * (1 << 20))
        answer = sock.recv(4096).decode(errors="replace")
    # The router closes the connection with the client's bytes unread, so the kernel resets
    # it, which may cut the error's body short: the status line is what is sure to arrive.
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    grown = psutil.Process(pid).memory_info().rss - before
    assert grown < 50 << 20, f"the router grew by {grown >> 20} MiB"


def complete_on_a_new_connection(router: str) -> None:
    """One completion of model `m` through `router`, on a connection of its own."""
    r = httpx.post(
        f"{router}/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 1},
        headers={"authorization": f"Bearer {KEY}", "connection": "close"},
        timeout=20,
    )
    assert r.status_code == 200, r.text


def two_workers(procs: Procs, tmp_path: Path) -> tuple[Path, subprocess.Popen[bytes], Any]:
    """A router of `workers: 2` with the client key `KEY` and no model, started and ready:
    its config file, its process and its ready file."""
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "port": 0,
                "push_port": 0,
                "push_token": PUSH_TOKEN,
                "workers": 2,
                "api_keys": [{"name": "t", "key": KEY}],
                "models": [],
            }
        )
    )
    ready = tmp_path / "router.json"
    proc = procs.start("router", "--config", str(config), "--ready-file", str(ready), log="router")
    return config, proc, wait_json(ready, proc, timeout=60)


def test_router_workers_share_one_port_and_every_push(procs: Procs, tmp_path: Path) -> None:
    """`workers: 2`: two processes accept on the client port, and a table pushed to the
    parent reaches both (a worker that missed it would answer 404 for the new model)."""
    engine, _ = engine_of(procs, tmp_path, "m", "engine")
    _, proc, urls = two_workers(procs, tmp_path)
    router, push = urls["urls"]["router"], urls["urls"]["push"]
    workers = [psutil.Process(pid) for pid in urls["workers"]]
    assert len(workers) == 2
    table = {"epoch": 1, "version": 3, "models": [{"name": "m", "endpoints": [engine]}]}
    admin = {"authorization": f"Bearer {PUSH_TOKEN}"}
    taken = httpx.put(f"{push}/v1/routing", json=table, headers=admin, timeout=20)
    assert taken.status_code == 200 and taken.json()["applied"] is True
    held = httpx.get(f"{push}/v1/routing/held", headers=admin, timeout=20).json()
    assert held == {"applied": True, "epoch": 1, "version": 3}
    # Its load says keys' limits are counted per worker (no limits_store): the Keys page
    # says so (issue 57).
    load = httpx.get(f"{push}/v1/load", params={"wait": 0}, headers=admin, timeout=20)
    assert load.json()["limit_counts"] == 2, load.text
    before = [w.cpu_times() for w in workers]
    for _ in range(60):  # a new connection each: the kernel spreads them over the workers
        complete_on_a_new_connection(router)
    after = [w.cpu_times() for w in workers]
    busy = [a.user + a.system - b.user - b.system for a, b in zip(after, before, strict=True)]
    assert all(b > 0.01 for b in busy), f"CPU seconds per worker: {busy}"
    # One scrape of the parent's push API counts every worker's requests (`/metrics` is where
    # Prometheus looks; the client port serves none).
    assert httpx.get(f"{router}/metrics", timeout=20).status_code == 404
    for url, headers in ((f"{push}/metrics", admin), (f"{push}/v1/metrics", admin)):
        page = httpx.get(url, headers=headers, timeout=20)
        assert page.status_code == 200, page.text
        counted = sum(
            s.value
            for family in text_string_to_metric_families(page.text)
            for s in family.samples
            if s.name == "modelfleet_router_requests_total"
        )
        assert counted == 60, (url, counted)
    # Usage is collected from every worker through the parent, and forgotten once acknowledged.
    report = httpx.get(f"{push}/v1/usage", headers=admin, timeout=20).json()
    assert len(report["batches"]) == 2  # one per worker: each served some of the 60
    assert sum(r["requests"] for b in report["batches"] for r in b["rows"]) == 60
    ack = {"batches": [[b["run"], b["batch"]] for b in report["batches"]]}
    assert httpx.post(f"{push}/v1/usage/ack", json=ack, headers=admin, timeout=20).is_success
    assert httpx.get(f"{push}/v1/usage", headers=admin, timeout=20).json() == {"batches": []}
    # A worker that dies is restarted, and serves the table it shares at once.
    workers[0].kill()
    workers[0].wait(timeout=10)

    def new_worker_serves() -> bool:
        complete_on_a_new_connection(router)
        return len([c for c in psutil.Process(proc.pid).children() if c.is_running()]) == 2

    wait_for("the killed worker to be restarted", new_worker_serves, timeout=60)
    # Stopped cleanly, it leaves nothing behind: its workers' folder (configs, ready files,
    # the shared table) once stayed in /tmp after every run.
    folder = Path(workers[1].cmdline()[workers[1].cmdline().index("--config") + 1]).parent
    assert folder.is_dir() and folder.name.startswith("modelfleet-router-")
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert not folder.exists()


def test_router_workers_end_with_their_parent_and_no_router_starts_beside_them(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue 39: with `workers: N`, kill -9 of the router's parent left its workers serving
    the port with no parent, and a router started again shared the port with them (they never
    got new tables or keys). Now the workers end with their parent, and a router refuses a
    client port that another process holds, naming it."""
    config, proc, found = two_workers(procs, tmp_path)
    workers = [psutil.Process(pid) for pid in found["workers"]]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(
        "the workers to end with their parent",
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
        30,
    )

    # A port held by another process (as orphaned workers held it): refused, naming it.
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        data = yaml.safe_load(config.read_text())
        config.write_text(yaml.safe_dump({**data, "port": holder.getsockname()[1]}))
        done = subprocess.run(
            [sys.executable, "-m", "modelfleet", "router", "--config", str(config)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0
        assert f"is held by pid {os.getpid()}" in done.stderr, done.stderr
    finally:
        holder.close()


def counts(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape that may only grow (counters, histograms), by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        if family.type in ("counter", "histogram")
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_router_counters_never_go_back_when_a_worker_dies_or_stalls(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue 41: with `workers: 2`, the summed counters went back when a worker stalled (left
    out of the sum) or was restarted (from zero), and Prometheus read each drop as a reset:
    403 requests counted in a minute with none sent. Under load, one worker is killed -9 and
    the other stopped (SIGSTOP); no scrape of the parent shows a count lower than one shown
    before."""
    engine, _ = engine_of(procs, tmp_path, "m", "engine")
    _, proc, urls = two_workers(procs, tmp_path)
    router, push = urls["urls"]["router"], urls["urls"]["push"]
    admin = {"authorization": f"Bearer {PUSH_TOKEN}"}
    table = {"epoch": 1, "version": 1, "models": [{"name": "m", "endpoints": [engine]}]}
    assert httpx.put(f"{push}/v1/routing", json=table, headers=admin, timeout=20).is_success
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):  # a stopped worker's connections wait
                httpx.post(
                    f"{router}/v1/completions",
                    json={"model": "m", "prompt": "x", "max_tokens": 1},
                    headers={"authorization": f"Bearer {KEY}", "connection": "close"},
                    timeout=2,
                )

    shown: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    scrapes = 0

    def scrape() -> None:
        nonlocal scrapes
        for url in (f"{push}/metrics", f"{push}/v1/metrics"):
            page = httpx.get(url, headers=admin, timeout=3)
            assert page.status_code == 200, page.text
            now = counts(page.text)
            went_back = {k: (v, now.get(k, 0.0)) for k, v in shown.items() if now.get(k, 0.0) < v}
            assert not went_back, f"{url}, after {scrapes} scrapes: {went_back}"
            shown.update(now)
            scrapes += 1

    def requests_shown() -> float:
        return sum(
            v for (name, _), v in shown.items() if name == "modelfleet_router_requests_total"
        )

    loaders = [threading.Thread(target=load) for _ in range(4)]
    for t in loaders:
        t.start()
    try:
        first, second = (psutil.Process(pid) for pid in urls["workers"])
        wait_for("both workers counted", lambda: scrape() or requests_shown() > 40, 30)
        first.kill()
        first.wait(timeout=10)
        children = psutil.Process(proc.pid).children

        def restarted() -> bool:
            scrape()
            return len([c for c in children() if c.pid != first.pid and c.is_running()]) == 2

        wait_for("the killed worker restarted, scraped meanwhile", restarted, 60)
        before = requests_shown()
        wait_for(
            "the restarted worker counted on",
            lambda: scrape() or requests_shown() > before + 40,
            30,
        )
        second.suspend()
        try:
            for _ in range(4):
                scrape()
        finally:
            second.resume()
        wait_for(
            "the stopped worker counted on", lambda: scrape() or requests_shown() > before + 80, 30
        )
    finally:
        stop.set()
        for t in loaders:
            t.join(timeout=10)
    assert scrapes >= 10
