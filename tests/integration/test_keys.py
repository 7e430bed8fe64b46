"""Client API keys managed live, with real processes: a fleet as `up` starts one plus a second
router, keys made, changed and revoked with `ctl`, seen by both routers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import yaml

from modelfleet.up.kept import load_or_make

from ..redis_kit import redis_server
from .conftest import Operator, Procs, fleet_of, wait_for, wait_json

A = {"name": "a", "engine": "sim", "args": ["--ttft", "0.01", "--itl", "0.002"]}
B = {"name": "b", "engine": "sim"}


def second_router(procs: Procs, tmp: Path, push_token: str, **settings: object) -> tuple[str, str]:
    """A router with no keys of its own, pushed to by the fleet's control plane; its client
    and push URLs."""
    config = tmp / "router-2.yaml"
    config.write_text(
        yaml.safe_dump({"port": 0, "push_port": 0, "push_token": push_token, **settings})
    )
    ready = tmp / "router-2.json"
    proc = procs.start("router", "--config", str(config), "--ready-file", str(ready), log="r2")
    urls = wait_json(ready, proc)["urls"]
    return urls["router"], urls["push"]


def status_with(router: str, key: str, model: str = "a") -> int:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        f"{router}/v1/completions", json=body, headers=headers, timeout=10
    ).status_code


def test_keys_made_changed_and_revoked_with_ctl_hold_on_every_router(
    procs: Procs, tmp_path: Path
) -> None:
    kept = load_or_make(tmp_path / "state").kept  # the fleet's tokens, before it starts
    other, other_push = second_router(procs, tmp_path, kept.admin_token)
    with fleet_of(tmp_path, [A, B], extra_routers=(other_push,)) as fleet:
        op = Operator(fleet, tmp_path)
        routers = [fleet.router_url, other]
        wait_for("a and b to serve", lambda: op.serves("a") and op.serves("b"))

        made = json.loads(op.ctl("keys", "create", "alice", "--models", "a", "-o", "json").stdout)
        key = made["key"]
        assert made["models"] == ["a"] and key.startswith(made["prefix"])
        wait_for("alice's key on both routers", lambda: all(
            status_with(r, key) == 200 for r in routers))  # fmt: skip
        assert [status_with(r, key, "b") for r in routers] == [404, 404]  # not its model

        listed = json.loads(op.ctl("keys", "list", "-o", "json").stdout)["keys"]
        assert [(k["name"], k["prefix"]) for k in listed] == [("alice", made["prefix"])]
        assert key not in op.ctl("keys", "list").stdout  # the table shows the prefix only

        op.ctl("keys", "update", "alice", "--clear", "models")
        wait_for("alice's key to reach b", lambda: all(
            status_with(r, key, "b") == 200 for r in routers))  # fmt: skip

        # Bad input: a clear error, a non-zero exit, and nothing changed.
        for args, says in (
            (("keys", "create", "alice"), "exists"),
            (("keys", "create", "bob", "--rpm", "0"), "--rpm: Input should be greater than 0"),
            (("keys", "create", "bob", "--models", "nope"), "not in the catalog"),
            (("keys", "create", "bob", "--expires", "2020-01-01"), "in the past"),
            (("keys", "revoke", "nope"), "no key named 'nope'"),
        ):
            done = op.ctl(*args, check=False)
            assert done.returncode != 0 and says in done.stderr, (args, done.stderr)
        names = [k["name"] for k in json.loads(op.ctl("keys", "list", "-o", "json").stdout)["keys"]]
        assert names == ["alice"]

        op.ctl("keys", "revoke", "alice")
        revoked = time.monotonic()
        wait_for("both routers to refuse alice's key", lambda: all(
            status_with(r, key) == 401 for r in routers), timeout=5, every=0.02)  # fmt: skip
        took = time.monotonic() - revoked
        print(f"revoked key refused by both routers {took:.2f} s after ctl returned")
        assert took < 1.0
        assert status_with(fleet.router_url, fleet.api_key) == 200  # up's own key stays


def test_a_keys_limits_hold_across_two_routers_sharing_redis(procs: Procs, tmp_path: Path) -> None:
    """60 requests per minute for a key, 100 requests spread over two routers: at most 60
    succeed within the minute, the rest get 429 with Retry-After; and a token limit holds
    against two long requests on different routers by the first one's reservation."""
    with redis_server(tmp_path) as store:
        kept = load_or_make(tmp_path / "state").kept
        other, other_push = second_router(procs, tmp_path, kept.admin_token, limits_store=store)
        options = {"extra_routers": (other_push,), "router": {"limits_store": store}}
        with fleet_of(tmp_path, [A, B], **options) as fleet:
            op = Operator(fleet, tmp_path)
            routers = [fleet.router_url, other]
            wait_for("a to serve", lambda: op.serves("a"))
            made = op.ctl("keys", "create", "bob", "--models", "a", "--rpm", "60", "-o", "json")
            key = json.loads(made.stdout)["key"]
            before: list[int] = []  # answers while waiting for the key: they count too

            def on_both() -> bool:
                codes = [status_with(r, key) for r in routers]
                before.extend(c for c in codes if c == 200)
                return codes == [200, 200]

            wait_for("bob's key on both routers", on_both)
            started = time.monotonic()
            answers = [post(routers[i % 2], key) for i in range(100)]
            took = time.monotonic() - started
            ok = [r for r in answers if r.status_code == 200]
            refused = [r for r in answers if r.status_code == 429]
            print(f"100 requests in {took:.1f} s: {len(ok)} answered, {len(refused)} refused")
            assert took < 60 and len(ok) + len(refused) == 100
            assert len(ok) + len(before) == 60  # exactly: requests per minute are counted exactly
            for r in refused:
                assert int(r.headers["retry-after"]) >= 1
                assert "key 'bob'" in r.json()["error"]["message"] and key not in r.text
            assert {i % 2 for i, r in enumerate(answers) if r.status_code == 429} == {0, 1}

            made = op.ctl("keys", "create", "carol", "--models", "a", "--tpm", "1000", "-o", "json")
            carol = json.loads(made.stdout)["key"]
            wait_for("carol's key on both routers", lambda: all(
                status_with(r, carol) == 200 for r in routers))  # fmt: skip
            long = {"model": "a", "prompt": "go on", "max_tokens": 600, "stream": True}
            headers = {"authorization": f"Bearer {carol}"}
            with httpx.stream("POST", f"{routers[0]}/v1/completions", json=long, headers=headers,
                              timeout=30) as first:  # fmt: skip
                assert first.status_code == 200  # in flight, holding its reservation of ~600
                second = httpx.post(f"{routers[1]}/v1/completions", json=long, headers=headers)
                assert second.status_code == 429
                assert second.json()["error"]["type"] == "tokens"
                first.read()


def post(router: str, key: str) -> httpx.Response:
    body = {"model": "a", "prompt": "hi", "max_tokens": 1}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=10)


def test_ctl_usage_shows_the_tokens_the_openai_client_saw_per_key_and_model(
    tmp_path: Path,
) -> None:
    with fleet_of(tmp_path, [A, B], control_plane={"usage_interval": 0.5}) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("a and b to serve", lambda: op.serves("a") and op.serves("b"))
        made = json.loads(op.ctl("keys", "create", "dave", "-o", "json").stdout)
        wait_for("dave's key on the router", lambda: httpx.get(  # /v1/models: no usage
            f"{fleet.router_url}/v1/models", headers={"authorization": f"Bearer {made['key']}"}
        ).status_code == 200)  # fmt: skip
        client = openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key=made["key"],
                               max_retries=0, timeout=20)  # fmt: skip
        saw = {"a": [0, 0, 0], "b": [0, 0, 0]}  # requests, prompt and completion tokens
        for model, stream in (("a", False), ("a", True), ("b", False)):
            if stream:
                chunks = list(client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "count to five"}],
                    max_tokens=5, stream=True, stream_options={"include_usage": True}))  # fmt: skip
                used = chunks[-1].usage
            else:
                used = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                ).usage
            assert used is not None
            saw[model][0] += 1
            saw[model][1] += used.prompt_tokens
            saw[model][2] += used.completion_tokens
        want = {m: tuple(v) for m, v in saw.items()}

        def counted() -> dict[str, tuple[int, int, int]] | None:
            rows = json.loads(op.ctl("usage", "--key", "dave", "-o", "json").stdout)["usage"]
            got = {r["model"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"])
                   for r in rows}  # fmt: skip
            return got if got == want else None

        wait_for(f"ctl usage to show {want}", counted, timeout=15, every=0.3)
        table = op.ctl("usage", "--model", "a", "--key", "dave", "-o", "csv").stdout.splitlines()
        assert table[0] == "hour,key,model,requests,prompt_tokens,completion_tokens,errors"
        assert [line.split(",")[1:4] for line in table[1:]] == [["dave", "a", str(want["a"][0])]]
        [listed] = json.loads(op.ctl("keys", "list", "-o", "json").stdout)["keys"]
        assert listed["requests"] == sum(v[0] for v in want.values())
        assert listed["last_used_at"] is not None
        bad = op.ctl("usage", "--since", "forever", check=False)
        assert bad.returncode == 1 and "not a duration" in bad.stderr
