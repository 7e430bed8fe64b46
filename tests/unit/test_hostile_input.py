"""A security review's findings, in-process: the token is checked before anything else (on a
follower too) and wrong ones are throttled per address on every door; documents nested too
deep are refused before a parser sees them; wrong-typed content parts are a 400; ctl prints
the names agents chose with their control characters escaped."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from modelfleet.controlplane.keys import KeyRefused, parse_expiry
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.core import nesting, yamltext
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.core.throttle import Throttle
from modelfleet.core.units import DURATION_PATTERN
from modelfleet.ctl.render import print_nodes
from modelfleet.http.openai_api import BadRequest, check_generation, parse_body
from modelfleet.messages import admin
from modelfleet.store import SeenControlPlane

from .test_admin_api import control_plane
from .test_controlplane import TOKEN

GUESSER = "203.0.113.7"
EXPIRES_PATTERN = admin.KeyCreate.model_json_schema()["properties"]["expires"]["anyOf"][0][
    "pattern"
]


async def _ask(
    app: Any, method: str, path: str, source: str = GUESSER, **kwargs: Any
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=(source, 4000))
    async with httpx.AsyncClient(transport=transport, base_url="http://cp") as c:
        return await c.request(method, path, **kwargs)


def test_a_try_is_counted_as_it_arrives_not_when_its_secret_is_judged() -> None:
    """The dashboard's sign-in took 300 heads, then their bodies: each try was let in before
    the first was judged a failure. Counted as they arrive, a fourth waits at once."""
    t = Throttle(free=3, base=1.0)
    taken = [t.attempt("a", 0.0) for _ in range(5)]
    assert [v.wait for v in taken] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert [v.then for v in taken[:3]] == [0.0, 0.0, 1.0]  # for the log line of a failure
    t.succeeded("a")  # the right secret forgets the address
    assert t.attempt("a", 0.0).wait == 0
    t.uncount("a")  # refused for another reason than its secret: not counted
    assert "a" not in t._seen


def guessed(cp: ControlPlane, tries: int, path: str = "/v1/catalog") -> list[httpx.Response]:
    _, admin_app = create_apps(cp)

    async def go() -> list[httpx.Response]:
        wrong = {"authorization": "Bearer not-the-token"}
        return [await _ask(admin_app, "GET", path, headers=wrong) for _ in range(tries)]

    return asyncio.run(go())


def test_admin_token_guesses_are_throttled_per_address_with_a_log_line_per_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """200 guesses at the admin token were 200 x 401 and no log line. Past three failures
    an address waits (429 with Retry-After), refused unheard and counted, and the log says
    one line per failure it heard."""
    cp = control_plane()
    with caplog.at_level(logging.WARNING, "modelfleet.controlplane"):
        answers = guessed(cp, 200)
    assert [a.status_code for a in answers[:3]] == [401, 401, 401]
    assert {a.status_code for a in answers[3:]} == {429}
    assert answers[3].headers["retry-after"] == "1"
    assert f"too many wrong admin tokens from {GUESSER}" in answers[3].json()["error"]
    lines = [r.getMessage() for r in caplog.records if "an admin API request" in r.getMessage()]
    assert len(lines) == 3 and "failing again and again" in lines[-1], lines
    assert cp.metrics.throttled.labels("admin")._value.get() == 197
    # Another address is not slowed; a request with no token at all guesses nothing.
    _, admin_app = create_apps(cp)
    ok = {"authorization": f"Bearer {TOKEN}"}
    assert asyncio.run(_ask(admin_app, "GET", "/v1/catalog", "198.51.100.1", headers=ok)).is_success
    assert asyncio.run(_ask(admin_app, "GET", "/v1/catalog", "198.51.100.2")).status_code == 401


def test_the_admin_token_is_one_throttle_on_the_api_and_at_the_dashboards_sign_in() -> None:
    from modelfleet.controlplane.dashboard import Dashboard

    cp = control_plane()
    guessed(cp, 3)
    _, admin_app = create_apps(cp, Dashboard(cp))
    signed = asyncio.run(_ask(admin_app, "POST", "/ui/login", data={"token": TOKEN}))
    assert signed.status_code == 429  # its address failed three times on the API


def a_follower(cp: ControlPlane) -> ControlPlane:
    """`cp` as a follower of a leader that said where it is."""
    cp.acting = lambda: False  # type: ignore[method-assign]
    cp.leadership.leader = "leader-host:/var/lib/modelfleet/secret-state-dir"
    cp.leadership.planes = [
        SeenControlPlane(cp.leadership.leader, "http://10.0.0.9:7001", "http://10.0.0.9:7002", 0)
    ]
    return cp


def test_a_follower_checks_the_admin_token_before_it_reads_the_store_or_names_its_leader() -> None:
    """On a follower, the follower's middleware ran before the token check: a GET without
    the token read the whole desired state from the store, a POST learned the leader's URL,
    host name and state dir."""
    cp = a_follower(control_plane())
    reads = 0
    read_desired = cp.read_desired

    async def counted() -> None:
        nonlocal reads
        reads += 1
        await read_desired()

    cp.read_desired = counted  # type: ignore[method-assign]
    _, admin_app = create_apps(cp)

    async def go() -> list[httpx.Response]:
        wrong = {"authorization": "Bearer nope"}
        return [
            await _ask(admin_app, "GET", "/v1/keys", f"198.51.100.{i}", headers=wrong)
            for i in range(20)
        ] + [
            await _ask(admin_app, "POST", "/v1/keys", GUESSER, json={"name": "x"}),
            await _ask(admin_app, "POST", "/v1/keys", GUESSER, json={"name": "x"}, headers=wrong),
        ]

    answers = asyncio.run(go())
    assert {a.status_code for a in answers} == {401}
    assert reads == 0
    for answer in answers[-2:]:
        assert "location" not in answer.headers
        assert "leader" not in answer.text and "10.0.0.9" not in answer.text
    # With the token, the follower answers as before: reads from the store, changes sent on.
    ok = {"authorization": f"Bearer {TOKEN}"}
    assert asyncio.run(_ask(admin_app, "GET", "/v1/keys", headers=ok)).status_code == 200
    assert reads == 1
    sent = asyncio.run(_ask(admin_app, "POST", "/v1/keys", headers=ok, json={"name": "x"}))
    assert sent.status_code == 307 and sent.headers["location"] == "http://10.0.0.9:7002/v1/keys"


def test_a_follower_checks_the_agent_token_before_it_names_its_leader() -> None:
    cp = a_follower(control_plane())
    cp.config = cp.config.model_copy(update={"agent_token": "agent-token-123"})
    agent_app, _ = create_apps(cp)

    async def go(token: str, path: str = "/v1/report") -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"}
        return await _ask(agent_app, "POST", path, headers=headers, content=b"{}")

    for path in ("/v1/report", "/v1/heartbeat", "/v1/join"):
        refused = asyncio.run(go("mfc_guess" if path != "/v1/join" else "nope", path))
        assert refused.status_code == 401, (path, refused.text)
        assert "location" not in refused.headers and "10.0.0.9" not in refused.text
        assert "leader" not in refused.text
    sent = asyncio.run(go("agent-token-123"))
    assert sent.status_code == 307 and sent.headers["location"] == "http://10.0.0.9:7001/v1/report"


def test_wrong_agent_tokens_are_throttled_per_address() -> None:
    cp = control_plane()
    cp.config = cp.config.model_copy(update={"agent_token": "agent-token-123"})
    agent_app, _ = create_apps(cp)

    async def go() -> list[httpx.Response]:
        headers = {"authorization": "Bearer wrong"}
        return [
            await _ask(agent_app, "POST", "/v1/heartbeat", headers=headers, content=b"{}")
            for _ in range(10)
        ]

    answers = asyncio.run(go())
    assert [a.status_code for a in answers] == [401] * 3 + [429] * 7
    assert answers[3].headers["retry-after"] == "1"
    assert cp.metrics.throttled.labels("agent")._value.get() == 7


# -- nesting ---------------------------------------------------------------------------------


def test_json_nested_past_the_limit_is_refused_in_one_linear_walk() -> None:
    nesting.check_json(b"[" * 64 + b"]" * 64)
    nesting.check_json(b'["' + b"[" * 500 + b'"]')  # brackets in a string are text
    nesting.check_json(b'"\\"' * 10_000 + b"[[[")  # an unclosed string is read once
    for deep in (b"[" * 65, b'{"a":' * 100_000, b'["]",' * 65 + b"[", b'[{"\\"]": [' * 40):
        with pytest.raises(nesting.TooDeep, match="nested more than 64 levels deep"):
            nesting.check_json(deep)
    # A string's closing bracket does not close: depth is counted as the parser counts it.
    with pytest.raises(nesting.TooDeep):
        nesting.check_json(b'["]]]]]]]]]]",' * 70)


@pytest.mark.parametrize(
    "text",
    [
        "models: " + "[" * 100_000 + "]" * 100_000,  # a segfault in PyYAML's composer
        "models: " + "{a: " * 20_000 + "1" + "}" * 20_000,  # seconds in libyaml's scanner
        "models:\n" + "".join("  " * i + "-\n" for i in range(200)),
        "models:\n" + "- " * 10_000 + "x\n",
    ],
)
def test_a_catalog_nested_too_deep_is_refused_naming_the_limit(text: str) -> None:
    with pytest.raises(CatalogInvalid) as refused:
        Catalog.from_yaml(text)
    assert "nested more than 64 levels deep" in str(refused.value)
    assert "the limit is 64" in str(refused.value)


def test_yaml_within_the_limit_loads_and_aliases_are_still_refused() -> None:
    deep: Any = "x"
    for _ in range(63):
        deep = [deep]
    assert yamltext.load(yaml.safe_dump({"a": deep})) == {"a": deep}
    with pytest.raises(yaml.YAMLError, match=r"line 2, column 4: an alias \(\*x\)"):
        yamltext.load("a: &x 1\nb: *x\n")


def test_deep_json_and_wrong_typed_content_parts_are_a_bad_request() -> None:
    """They were a 500 with a traceback (RecursionError in json.loads; a TypeError joining
    the parts' text)."""
    with pytest.raises(BadRequest, match="nested more than 64 levels deep"):
        parse_body(b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    for text in (5, None, ["a"], {"t": 1}):
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": text}]
        body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
        with pytest.raises(BadRequest) as refused:
            check_generation(body)
        assert refused.value.param == "messages[0].content[1].text"
    fine = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}]
    check_generation({"model": "m", "messages": [{"role": "user", "content": fine}]})


# -- ctl -------------------------------------------------------------------------------------


def test_ctl_prints_a_nodes_name_with_its_control_characters_escaped() -> None:
    evil = "n\x1b]0;pwned\x07\x1b[2J[red]x\u202e"
    gpu = admin.GpuInfo(
        index=0, model="H\x1b[31m100", memory_total=1, memory_free=1, healthy=False,
        reason="XID\x1b[5m", in_use=False,
    )  # fmt: skip
    node = admin.NodeInfo(
        name=evil, ready=True, mark="none", drain_grace_left_s=None, address="10.0.0.1",
        labels={}, last_heard_s=0.0, reports=1, heartbeats=0, gpus=[gpu], shards=0, replicas=0,
    )  # fmt: skip
    out = io.StringIO()
    print_nodes(admin.NodesAnswer(nodes=[node]), Console(file=out, width=300))
    printed = out.getvalue()
    assert "\x1b" not in printed and "\u202e" not in printed, repr(printed)
    assert "n\\x1b]0;pwned\\x07\\x1b[2J[red]x\\u202e" in printed
    assert "H\\x1b[31m100" in printed and "XID\\x1b[5m" in printed


# -- the admin API's document ----------------------------------------------------------------


def test_what_the_admin_document_allows_of_a_since_a_ttl_or_a_limit_is_accepted() -> None:
    """schemathesis' ST202: a `since` or a join token's `ttl` of 10^6 weeks (a duration, as
    far as the document said: it said any string) was refused as longer than 100 years, and
    a limit of 60.0 (an `integer` in JSON Schema) as not a whole number. A `since` now looks
    back at most 100 years and a `ttl` lasts at most 100 years, 60.0 is 60; what is refused
    is still refused (400), and the document says so (patterns from `units.py`)."""
    cp = control_plane()
    _, admin_app = create_apps(cp)
    ok = {"authorization": f"Bearer {TOKEN}"}

    async def go() -> list[httpx.Response]:
        asks = [
            ("GET", "/v1/events?since=1000000w", None),
            ("GET", "/v1/usage?since=99999999999d", None),
            ("POST", "/v1/keys", {"name": "k", "rpm": 60.0, "tpm": 1000}),
            ("GET", "/v1/events?since=soon", None),
            ("POST", "/v1/keys", {"name": "j", "rpm": 60.5}),
            ("POST", "/v1/keys", {"name": "j", "rpm": True}),
            ("POST", "/v1/join-tokens", {"ttl": "1000000w"}),
            ("POST", "/v1/join-tokens", {"ttl": "never\n"}),
            ("POST", "/v1/join-tokens", {"ttl": "0.0s"}),
        ]
        return [await _ask(admin_app, m, p, headers=ok, json=b) for m, p, b in asks]

    answers = asyncio.run(go())
    statuses = [a.status_code for a in answers]
    assert statuses == [200, 200, 200, 400, 400, 400, 200, 200, 400], [a.text for a in answers]
    assert answers[2].json()["rpm"] == 60
    assert answers[7].json()["expires_at"] is None and answers[6].json()["expires_at"]
    doc = admin_app.openapi()  # and the document says what is refused
    since = next(p for p in doc["paths"]["/v1/events"]["get"]["parameters"] if p["name"] == "since")
    assert since["schema"]["pattern"] == DURATION_PATTERN
    schema = doc["paths"]["/v1/join-tokens"]["post"]["requestBody"]["content"]["application/json"]
    ttl = schema["schema"]["properties"]["ttl"]["pattern"]
    assert re.search(ttl, "never\n") and re.search(ttl, "0.5s") and not re.search(ttl, "0.0s")
    limit = doc["paths"]["/v1/keys"]["post"]["requestBody"]["content"]["application/json"]
    assert limit["schema"]["properties"]["rpm"]["anyOf"][0]["exclusiveMinimum"] == 0


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.from_regex(EXPIRES_PATTERN))
def test_every_expiry_the_document_allows_is_taken_or_past(text: str) -> None:
    """A key's `expires` as the document states it (a pattern, `admin.Expires`) is a time
    `keys.parse_expiry` takes, or one already past (409: the clock's, not the form's)."""
    try:
        assert parse_expiry(text, 1.8e9) > 1.8e9
    except KeyRefused as refused:
        assert refused.status == 409 and "in the past" in str(refused), (text, refused)
