"""The dashboard in Debian's Chromium, driven by Playwright, against a fleet as `up` starts
one: sign in, see both default models serving, cordon a node from its page and see the page
change, open a replica's engine log, see it say when it is stale, chat in the Playground,
read the plots of models, nodes and keys over a range and after a restart; screenshots
kept."""

from __future__ import annotations

import contextlib
import html
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from playwright.sync_api import Browser, Dialog, Page, Request, sync_playwright

from modelfleet.up import FleetOptions, RunningFleet, start_fleet

from .conftest import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the machine's closed network needs: nothing in the background, no first-run page.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RunningFleet]:
    running = start_fleet(
        tmp_path / "state",
        FleetOptions(report_interval=0.5, control_plane={"series_interval": 1.0}),
    )
    try:
        yield running
    finally:
        running.fleet.stop()


def serving(fleet: RunningFleet) -> dict[str, int]:
    answer = httpx.get(
        f"{fleet.admin_url}/v1/replicas",
        headers={"authorization": f"Bearer {fleet.admin_token}"},
        timeout=10,
    ).json()
    counts: dict[str, int] = {}
    for r in answer["replicas"]:
        if r["state"] == "ready":
            counts[r["model"]] = counts.get(r["model"], 0) + 1
    return counts


def sign_in(page: Page, fleet: RunningFleet) -> None:
    page.goto(f"{fleet.admin_url}/ui/")
    assert page.url.endswith("/ui/login")  # no session: the login page
    page.fill("#token", fleet.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{fleet.admin_url}/ui/")


def test_an_operator_signs_in_sees_the_fleet_cordons_a_node_and_reads_a_log(
    browser: Browser, fleet: RunningFleet, tmp_path: Path
) -> None:
    wait_for(
        "both default models serving",
        lambda: serving(fleet) == {"sim-chat": 2, "sim-large": 1},
        timeout=60,
    )
    page = browser.new_page()
    page.set_default_timeout(10_000)
    sign_in(page, fleet)
    assert fleet.admin_token not in page.url
    cookies = {c["name"]: c for c in page.context.cookies()}
    assert cookies["modelfleet_ui"]["httpOnly"] and cookies["modelfleet_ui"]["sameSite"] == "Strict"

    # Both models serving, as the page shows them.
    page.locator('tr[data-model="sim-chat"] .serving').filter(has_text="2").wait_for()
    page.locator('tr[data-model="sim-large"] .serving').filter(has_text="1").wait_for()
    assert page.locator("tr[data-node]").count() == 2
    assert page.locator("i.gpu").count() == 8

    # A page load asks for its page, script and stylesheet, and opens its stream.
    asked: list[str] = []

    def note(request: Request) -> None:
        asked.append(request.url)

    page.on("request", note)
    page.reload()
    page.locator('tr[data-model="sim-chat"]').wait_for()
    wait_for("the live stream opened", lambda: any("/ui/live/" in u for u in asked), timeout=10)
    page.remove_listener("request", note)
    others = [u for u in asked if "/ui/live/" not in u]
    assert len(others) <= 5, others
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    assert (tmp_path / "overview.png").stat().st_size > 10_000

    # Cordon node-1 from its page: the confirmation says what happens, and the page changes
    # by its stream, with no reload.
    page.click('a[href="/ui/nodes/node-1"]')
    page.wait_for_url("**/ui/nodes/node-1")
    page.locator("#mark").filter(has_text="none").wait_for()
    said: list[str] = []

    def confirm(dialog: Dialog) -> None:
        said.append(dialog.message)
        dialog.accept()

    page.on("dialog", confirm)
    clicked = time.monotonic()
    page.click("button:text('Cordon')")
    page.locator("#mark").filter(has_text="cordoned").wait_for()
    seen_after = time.monotonic() - clicked
    assert said and said[0].startswith("Cordon node-1?")
    assert page.locator("button:text('Uncordon')").count() == 1
    marks = httpx.get(
        f"{fleet.admin_url}/v1/nodes",
        headers={"authorization": f"Bearer {fleet.admin_token}"},
        timeout=10,
    ).json()["nodes"]
    assert {n["name"]: n["mark"] for n in marks}["node-1"] == "cordoned"
    print(f"cordon visible on the page {seen_after:.2f}s after the click")

    # A replica's engine log, live.
    page.locator("a.log-link").first.click()
    page.wait_for_url("**/ui/logs/**")
    page.locator("#log div").filter(has_text="engine-sim: loading").first.wait_for()


def test_an_open_page_says_when_it_is_no_longer_live_and_leads_back_to_sign_in(
    browser: Browser, fleet: RunningFleet, tmp_path: Path
) -> None:
    """Issue 41: after a control-plane restart an open dashboard went on showing old data as
    live (a node "heard now"), getting 401 every few seconds, with no word of it and no way
    back to sign-in. A frozen control plane, then a restarted one: each is said."""
    page = browser.new_page()
    page.set_default_timeout(20_000)
    sign_in(page, fleet)
    page.locator("tr[data-node]").first.wait_for()
    banner = page.locator("#stale")
    assert banner.is_hidden()
    [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
    frozen = psutil.Process(cp.proc.pid)
    frozen.suspend()
    try:
        banner.filter(has_text="does not answer").wait_for()
        assert "as of" in banner.inner_text()
        page.screenshot(path=str(tmp_path / "not-answering.png"), full_page=True)
    finally:
        frozen.resume()
    banner.wait_for(state="hidden")  # live again, by its stream
    fleet.fleet.restart(cp)
    banner.filter(has_text="Your session has ended").wait_for()
    page.screenshot(path=str(tmp_path / "session-ended.png"), full_page=True)
    assert (tmp_path / "session-ended.png").stat().st_size > 10_000
    page.click("#stale a")
    page.wait_for_url("**/ui/login")
    sign_in(page, fleet)
    page.locator("tr[data-node]").first.wait_for()
    assert banner.is_hidden()


def test_the_playground_chats_with_a_model_through_the_router_with_a_key_made_there(
    browser: Browser, fleet: RunningFleet, tmp_path: Path
) -> None:
    """Issue 41: GPUStack and LiteLLM give the operator a chat with any model from the
    browser. Here: a key made on the page, a streamed answer through the router, the replica
    that answered and the time to the first token; a wrong key refused in the router's words;
    then a LoRA adapter added to the catalog, chosen as model:adapter and answered as it."""
    wait_for("sim-chat serving", lambda: serving(fleet).get("sim-chat") == 2, timeout=60)
    page = browser.new_page()
    page.set_default_timeout(20_000)
    sign_in(page, fleet)
    page.click("a[href='/ui/playground']")
    page.wait_for_url("**/ui/playground")
    assert page.locator("#model option").all_inner_texts() == ["sim-chat", "sim-large"]
    page.fill("#key", "sk-not-a-key-of-this-fleet")
    page.dispatch_event("#key", "change")
    page.fill("#prompt", "Hello there")
    page.click("#send")
    page.locator(".message.assistant.error").filter(has_text="401").wait_for()

    page.click("#make-key")
    page.locator("#key-note").filter(has_text="made playground-").wait_for()
    assert page.input_value("#key").startswith("mf-")  # a client key of this fleet
    page.select_option("#model", "sim-chat")
    page.fill("#prompt", "Tell me about GPUs")
    page.click("#send")
    page.locator("#answer-info").filter(has_text="first token after").wait_for()
    info = page.inner_text("#answer-info")
    assert info.startswith("answered by sim-chat-"), info
    assert " tokens" in info
    answers = page.locator(".message.assistant").all_inner_texts()
    assert len(answers) == 2 and len(answers[-1].split()) > 3, answers
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 10_000
    admin = {"authorization": f"Bearer {fleet.admin_token}"}
    events = httpx.get(
        f"{fleet.admin_url}/v1/events", params={"for": "key"}, headers=admin, timeout=10
    ).json()["events"]
    assert any(e["reason"] == "KeyCreated" and "playground-" in e["regarding"] for e in events)

    # An adapter, chosen as model:adapter: answered by a replica holding it, counted as it.
    text = fleet.catalog_file.read_text().replace(
        "  - name: sim-chat\n",
        "  - name: sim-chat\n    max_loras: 2\n    adapters: [{name: sql, source: org/sql-lora}]\n",
    )
    fleet.catalog_file.write_text(text)

    def sql_loaded() -> bool:
        replicas = httpx.get(f"{fleet.admin_url}/v1/replicas", headers=admin, timeout=10)
        return any(
            a["name"] == "sql" and a["state"] == "loaded"
            for r in replicas.json()["replicas"]
            if r["model"] == "sim-chat" and r["state"] == "ready"
            for a in r["shards"][0]["adapters"]
        )

    wait_for("the sql adapter loaded in a ready sim-chat replica", sql_loaded, timeout=60)
    page.reload()
    wait_for("sim-chat:sql offered", lambda: "sim-chat:sql" in page.locator(
        "#model option").all_inner_texts(), timeout=10)  # fmt: skip
    page.select_option("#model", "sim-chat:sql")
    page.fill("#prompt", "SELECT something")
    page.click("#send")
    page.locator("#answer-info").filter(has_text="first token after").wait_for()
    assert page.inner_text("#answer-info").startswith("answered by sim-chat-")
    metrics = httpx.get(f"{fleet.push_url}/metrics", headers=admin, timeout=10).text
    assert 'modelfleet_router_requests_total{model="sql",status="200"} 1.0' in metrics, metrics


def test_the_playground_says_it_cannot_reach_the_fleet_instead_of_asking_for_ever(
    browser: Browser, fleet: RunningFleet, tmp_path: Path
) -> None:
    """Issue 57: with the control plane down the Playground hung on "asking ..." for good.
    A router that does not answer, a frozen control plane and a stopped one: each is said,
    as the fleet not reached."""
    wait_for("sim-chat serving", lambda: serving(fleet).get("sim-chat") == 2, timeout=60)
    page = browser.new_page()
    page.set_default_timeout(20_000)
    sign_in(page, fleet)
    page.goto(f"{fleet.admin_url}/ui/playground")
    page.click("#make-key")
    page.locator("#key-note").filter(has_text="made playground-").wait_for()
    errors = page.locator(".message.assistant.error")

    def ask(prompt: str, said: str) -> None:
        before = errors.count()
        page.fill("#prompt", prompt)
        page.click("#send")
        errors.nth(before).filter(has_text=said).wait_for()
        assert page.inner_text("#answer-info") == "cannot reach the fleet"

    [router] = [c for c in fleet.fleet.children if c.role == "router"]
    router.proc.kill()
    router.proc.wait(timeout=10)
    ask("Anyone there?", "Cannot reach the fleet: the router at ")
    [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
    frozen = psutil.Process(cp.proc.pid)
    frozen.suspend()
    try:
        ask("And now?", "Cannot reach the fleet: the control plane does not answer")
    finally:
        frozen.resume()
    cp.proc.kill()
    cp.proc.wait(timeout=10)
    ask("And now that it is gone?", "Cannot reach the fleet: the control plane does not answer")
    assert errors.count() == 3
    page.screenshot(path=str(tmp_path / "playground-unreachable.png"), full_page=True)


def plotted(page: Page) -> dict[str, Any]:
    """The numbers the page's plots draw, as the live part now holds them."""
    return dict(json.loads(page.locator(".plots").get_attribute("data-plot") or "{}"))


def any_above(line: list[float | None] | None, floor: float = 0.0) -> bool:
    return any(v is not None and v > floor for v in line or [])


def test_plots_of_models_nodes_and_keys_cover_a_range_and_outlive_a_restart(
    browser: Browser, fleet: RunningFleet, tmp_path: Path
) -> None:
    """Issue 41: no GPU memory or utilisation over time per node, no requests/s or 429s per
    key, no time range, and model plots lost at each control-plane restart. Under load from
    two keys (one over its limit): a node's GPUs plotted as the simulated engines hold and
    use them, each key's requests and 429s, a model's requests in the 1 h and 24 h ranges,
    and the same points again after the control plane restarted."""
    wait_for("sim-chat serving", lambda: serving(fleet).get("sim-chat") == 2, timeout=60)
    admin = {"authorization": f"Bearer {fleet.admin_token}"}
    made = httpx.post(f"{fleet.admin_url}/v1/keys", json={"name": "limited", "rpm": 2},
                      headers=admin, timeout=10)  # fmt: skip
    assert made.status_code == 200, made.text
    limited = made.json()["key"]

    def ask(key: str) -> int:
        answer = httpx.post(
            f"{fleet.router_url}/v1/chat/completions",
            json={"model": "sim-chat", "max_tokens": 40,
                  "messages": [{"role": "user", "content": "plot me"}]},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )  # fmt: skip
        return answer.status_code

    wait_for("the limited key taken by the router", lambda: ask(limited) in (200, 429))
    stop = threading.Event()
    statuses: list[int] = []

    def load(key: str) -> None:
        while not stop.is_set():
            statuses.append(ask(key))

    loaders = [threading.Thread(target=load, args=(k,), daemon=True)
               for k in (fleet.api_key, fleet.api_key, fleet.api_key, limited)]  # fmt: skip
    for t in loaders:
        t.start()
    page = browser.new_page()
    page.set_default_timeout(20_000)
    try:
        sign_in(page, fleet)
        page.goto(f"{fleet.admin_url}/ui/models/sim-chat")
        wait_for("sim-chat's requests plotted",
                 lambda: any_above(plotted(page).get("requests_per_s")), timeout=30)  # fmt: skip
        assert any_above(plotted(page).get("request_p95_ms"))
        assert "a point per 20 s" in page.inner_text(".ranges")  # 3,600 points of 1 s, merged

        page.goto(f"{fleet.admin_url}/ui/nodes/node-1")
        wait_for(
            "node-1's GPUs plotted busy, holding memory",
            lambda: (
                any_above(plotted(page).get("utilization_pct"))
                and any_above(plotted(page).get("memory_used_gib"))
            ),
            timeout=30,
        )
        held = max(v for v in plotted(page)["memory_used_gib"] if v is not None)
        total = max(v for v in plotted(page)["memory_total_gib"] if v is not None)
        assert 0 < held < total  # as vLLM would: 90 % of the GPUs its engines run on
        page.screenshot(path=str(tmp_path / "node-plots.png"), full_page=True)

        page.goto(f"{fleet.admin_url}/ui/usage")
        wait_for(
            "the limited key's 429s plotted",
            lambda: any_above((plotted(page).get("limited_per_s") or {}).get("limited")),
            timeout=30,
        )
        requests = plotted(page)["requests_per_s"]
        assert any_above(requests.get("up")) or any(any_above(v) for v in requests.values())
        page.screenshot(path=str(tmp_path / "key-plots.png"), full_page=True)
    finally:
        stop.set()
        for t in loaders:
            t.join(30)
    assert 429 in statuses and 200 in statuses

    # The day's range: quarter-hour points, from the same store.
    page.goto(f"{fleet.admin_url}/ui/models/sim-chat")
    page.click(".ranges a:text('24h')")
    page.wait_for_url("**/ui/models/sim-chat?range=24h")
    page.locator(".ranges a.current").filter(has_text="24h").wait_for()
    assert "a point per 15 min" in page.inner_text(".ranges")
    assert any_above(plotted(page).get("requests_per_s"))
    page.screenshot(path=str(tmp_path / "model-24h.png"), full_page=True)

    # A restart: the plots still hold what was counted before it.
    page.goto(f"{fleet.admin_url}/ui/models/sim-chat")
    before = plotted(page)
    counted_before = [at for at, v in zip(before["at"], before["requests_per_s"], strict=True) if v]
    [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
    fleet.fleet.restart(cp)
    sign_in(page, fleet)
    page.goto(f"{fleet.admin_url}/ui/models/sim-chat")
    after = plotted(page)
    kept = [at for at, v in zip(after["at"], after["requests_per_s"], strict=True) if v]
    assert set(counted_before) <= set(kept), (counted_before, kept)
    page.screenshot(path=str(tmp_path / "model-after-restart.png"), full_page=True)


def live_html(ui: httpx.Client, path: str) -> str:
    """A dashboard page as served now: its live part rendered into it."""
    answer = ui.get(path, timeout=10)
    assert answer.status_code == 200, (path, answer.status_code)
    return answer.text


def plot_of(html_text: str) -> dict[str, Any]:
    found = re.search(r"data-plot='([^']*)'", html_text)
    return dict(json.loads(html.unescape(found.group(1)))) if found else {}


def test_pages_show_ejections_at_once_the_engines_ttft_and_kv_cache_with_router_workers(
    tmp_path: Path,
) -> None:
    """Issue 57, on a fleet as `up` starts one with router `workers: 2`: the replica page
    never showed its KV cache use (the workers' loads were summed without it); time to first
    token was the routers' time to first byte; and a replica out of rotation stayed serving
    on the overview and "ready" on its node's and model's pages (the parts' cache ignored
    ejections)."""
    options = FleetOptions(report_interval=0.5, router={"workers": 2},
                           control_plane={"series_interval": 1.0})  # fmt: skip
    running = start_fleet(tmp_path / "state", options)
    stop = threading.Event()
    loaders: list[threading.Thread] = []
    suspended: psutil.Process | None = None
    try:
        wait_for("sim-chat serving", lambda: serving(running).get("sim-chat") == 2, timeout=60)
        ui = httpx.Client(base_url=running.admin_url, follow_redirects=True)
        signed = ui.post("/ui/login", data={"token": running.admin_token}, timeout=10)
        assert signed.status_code == 200 and "/ui/login" not in str(signed.url)

        def ask() -> None:
            body = {"model": "sim-chat", "max_tokens": 20, "stream": True,
                    "messages": [{"role": "user", "content": "time me"}]}  # fmt: skip
            headers = {"authorization": f"Bearer {running.api_key}"}
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(f"{running.router_url}/v1/chat/completions", json=body,
                               headers=headers, timeout=30)  # fmt: skip

        loaders = [threading.Thread(target=ask, daemon=True) for _ in range(2)]
        for t in loaders:
            t.start()
        admin = {"authorization": f"Bearer {running.admin_token}"}
        replicas = httpx.get(f"{running.admin_url}/v1/replicas", headers=admin, timeout=10)
        victim = next(r for r in replicas.json()["replicas"] if r["model"] == "sim-chat")
        rid, node = victim["id"], victim["shards"][0]["node"]
        wait_for(
            "the replica page to show its KV cache in use",
            lambda: "KV cache" in live_html(ui, f"/ui/replicas/{rid}"),
            timeout=30,
        )
        plots = wait_for(
            "the engines' time to first token plotted",
            lambda: (
                (p := plot_of(live_html(ui, "/ui/models/sim-chat")))
                and any_above(p.get("first_token_p50_ms"))
                and any_above(p.get("first_byte_p50_ms"))
                and p
            ),
            timeout=60,
        )
        model_page = live_html(ui, "/ui/models/sim-chat")
        assert "time to first token at the engines" in model_page
        assert "time to first byte at the routers" in model_page
        assert len(plots["first_token_p50_ms"]) == len(plots["at"])
        stop.set()
        for t in loaders:
            t.join(30)

        # Each page rendered (and kept) while the replica serves; then its engine stops.
        pages = {"overview": "/ui/", "node": f"/ui/nodes/{node}", "model": "/ui/models/sim-chat"}
        for path in pages.values():
            live_html(ui, path)
        suspended = psutil.Process(victim["shards"][0]["pid"])
        suspended.suspend()
        wait_for(
            "a router to have the stopped replica out of rotation",
            lambda: httpx.get(
                f"{running.admin_url}/v1/replicas/{rid}", headers=admin, timeout=10
            ).json()["ejected"],
            timeout=60,
        )
        overview = live_html(ui, pages["overview"])
        row = re.search(r'/ui/models/sim-chat">sim-chat</a></td>.*?class="serving">(\d+)<',
                        overview, re.S)  # fmt: skip
        assert row is not None and row.group(1) == "1", "the overview still counts it serving"
        for what in ("node", "model"):
            shown = re.search(rf'data-replica="{rid}">.*?</tr>', live_html(ui, pages[what]), re.S)
            assert shown is not None and "out-of-rotation" in shown.group(0), what
    finally:
        stop.set()
        if suspended is not None:
            suspended.resume()
        for t in loaders:
            t.join(30)
        running.fleet.stop()
