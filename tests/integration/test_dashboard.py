"""The dashboard in Debian's Chromium, driven by Playwright, against a fleet as `up` starts
one: sign in, see both default models serving, cordon a node from its page and see the page
change, open a replica's engine log, and keep a screenshot of the overview."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

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
    that answered and the time to the first token; a wrong key refused in the router's words."""
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
    events = httpx.get(
        f"{fleet.admin_url}/v1/events",
        params={"for": "key"},
        headers={"authorization": f"Bearer {fleet.admin_token}"},
        timeout=10,
    ).json()["events"]
    assert any(e["reason"] == "KeyCreated" and "playground-" in e["regarding"] for e in events)
