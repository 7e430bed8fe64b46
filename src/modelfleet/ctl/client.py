"""Finding and calling the admin API; every answer is a model of `modelfleet.messages.admin`.

Where to find the admin API, in order: `--admin URL --token T`, then the variables
`MODELFLEET_ADMIN_URL` / `MODELFLEET_ADMIN_TOKEN`, then `<state-dir>/up.json` written by
`modelfleet up`. An https:// admin API is checked against the control plane's own CA:
`--ca FILE`, then `MODELFLEET_CA`, then up.json's `ca_file`.

Several control planes on one store: `--admin URL1,URL2,...`. Before a change, ctl asks every
one at once who leads (their status, ASK_S each: a frozen one costs no more) and sends the
change straight to the leader (`core.leader.leader_of`); while none leads, to those that
answered, never to one that did not (a frozen one would take the change and never answer). A
follower redirects a change to the leader (307), and ctl sends it there; one that does not
know where the leader is answers 503, and ctl asks again, going round for up to FOLLOW_FOR_S
(an election). A read goes to any that answers, the one that answered last first: a dead
control plane costs a refused connection, a frozen one CONNECT_TIMEOUT_S or READ_TIMEOUT_S.

A change ctl may send again (a catalog applied, a key made, changed or revoked, a node
marked) goes with a request id (the `Idempotency-Key` header; MODELFLEET_REQUEST_ID names
one): the control plane makes it at most once. One whose answer was "may have been made"
(the store did not answer in time) or that got no answer is sent again with the same id, for
up to RETRY_UNKNOWN_FOR_S, and ctl says which happened: made, made by the earlier attempt,
or not made; or, past that, that it may have been made and how to ask again. Any other
change that got no answer is never sent again: it may have been made.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from modelfleet.core.leader import Claim, leader_of
from modelfleet.messages import admin
from modelfleet.security.pki import PkiError, client_context

Answer = TypeVar("Answer", bound=BaseModel)


# With several admin APIs: a frozen one must not cost a whole request timeout each, and an
# election (a few seconds) is waited out by going round them again.
CONNECT_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 5.0
FOLLOW_FOR_S = 10.0
ROUND_PAUSE_S = 0.2
# A change whose outcome is not known is sent again with its request id for this long, a
# pause apart: a store stalled a few seconds is outlasted, and a control plane acts on a
# change that landed late as soon as its store answers.
RETRY_UNKNOWN_FOR_S = 12.0
RETRY_PAUSE_S = 1.0
# A request id to send with the change (to ask again about one that may have been made).
REQUEST_ID_ENV = "MODELFLEET_REQUEST_ID"
ASK_S = 1.0  # asking each admin API who leads: connect and answer within this


class CtlError(Exception):
    """A failure ctl reports as one line and a non-zero exit."""


class Unreachable(CtlError):
    """The admin API did not answer at all (not started yet, or not reachable from here)."""


class ServerTrouble(CtlError):
    """The admin API answered with a 5xx: it is there, but cannot answer now (its store is
    down, it is starting)."""


class MayHaveBeenMade(CtlError):
    """A change whose outcome is not known: the store did not answer in time, or the control
    plane did not answer at all."""


class _NotSent(Unreachable):
    """No connection was made: the request was surely not taken."""


class _Unanswered(Unreachable):
    """A connection was made and no answer came: a change may have been taken."""


class CatalogRefused(CtlError):
    """The admin API refused a catalog; `problems` lists every problem it found."""

    def __init__(self, message: str, problems: list[admin.CatalogProblem]) -> None:
        super().__init__(message)
        self.problems = problems


@dataclass(frozen=True)
class AdminTarget:
    url: str  # one admin API, or several, comma-separated
    token: str
    ca: Path | None = None  # the control plane's CA, for an https:// URL

    @property
    def urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.url.split(",") if u.strip()]


def resolve_target(
    admin_url: str | None, token: str | None, state_dir: Path, ca: Path | None = None
) -> AdminTarget:
    """Find the admin API from flags, environment, or the state dir's up.json."""
    admin_url = admin_url or os.environ.get("MODELFLEET_ADMIN_URL")
    token = token or os.environ.get("MODELFLEET_ADMIN_TOKEN")
    ca = ca or (Path(os.environ["MODELFLEET_CA"]) if os.environ.get("MODELFLEET_CA") else None)
    if admin_url is None or token is None:
        up_file = state_dir / "up.json"
        try:
            up = json.loads(up_file.read_text())
        except FileNotFoundError:
            raise CtlError(
                f"no admin API given, and no up.json in {state_dir.absolute()} (is "
                "`modelfleet up` running? if it runs with --state-dir DIR, give ctl the same "
                "--state-dir DIR or set MODELFLEET_STATE_DIR); elsewhere pass --admin URL "
                "--token T or set MODELFLEET_ADMIN_URL / MODELFLEET_ADMIN_TOKEN"
            ) from None
        except (OSError, ValueError) as exc:
            raise CtlError(f"cannot read {up_file}: {exc}") from exc
        admin_url = admin_url or ",".join(up.get("admin_urls") or [up.get("admin_url", "")])
        token = token or up.get("admin_token")
        if not admin_url or not token:
            raise CtlError(f"{up_file} has no admin_url / admin_token")
        if ca is None and up.get("ca_file"):
            ca = Path(up["ca_file"])
    if any(u.strip().startswith("https://") for u in admin_url.split(",")) and ca is None:
        raise CtlError(
            f"{admin_url} serves TLS: give ctl the control plane's CA to check it against "
            "(--ca FILE or MODELFLEET_CA; the control plane keeps it in its state dir, "
            "pki/ca.crt)"
        )
    return AdminTarget(admin_url.rstrip("/"), token, ca)


class AdminClient:
    """The admin API of one control plane, one method per route."""

    def __init__(
        self,
        target: AdminTarget,
        follow_for: float = FOLLOW_FOR_S,
        retry_for: float = RETRY_UNKNOWN_FOR_S,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self.follow_for = follow_for  # with several admin APIs: how long to look for a leader
        self.retry_for = retry_for  # how long a change of unknown outcome is sent again
        # How ctl says which attempt made a change sent more than once (stderr).
        self.say = say or (lambda text: print(f"ctl: {text}", file=sys.stderr))
        self._at = 0  # the admin API that answered last, in target.urls
        self._replayed = False  # the last answer was what an earlier attempt did
        self._verify: ssl.SSLContext | None = None
        if target.ca is not None:
            try:
                self._verify = client_context(target.ca.read_bytes())
            except FileNotFoundError as exc:
                raise Unreachable(f"no CA file {target.ca} (yet): {exc}") from exc
            except (OSError, PkiError) as exc:
                raise CtlError(f"cannot use the CA {target.ca}: {exc}") from exc

    def _call(
        self,
        answer: type[Answer],
        method: str,
        path: str,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        request_id: str | None = None,
    ) -> Answer:
        """Call the admin API; every failure becomes a one-line CtlError (CatalogRefused when
        a catalog was refused). With several admin APIs, ctl goes round them for up to
        `follow_for` seconds until one answers: a read is asked again anywhere, a change only
        where it surely was not taken (no connection was made, or a follower refused it), or
        where it is made at most once (`request_id`), and first to the leader, asked for
        (`_leader_first`). MayHaveBeenMade when a change got no answer, or one saying it may
        have been made."""
        urls = self.target.urls
        unanswered: str | None = None
        several = len(urls) > 1
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S) if several else 10.0
        deadline = time.monotonic() + (self.follow_for if several else 0.0)
        failed: dict[str, str] = {}  # each admin API's last failure, said when all fail
        while True:
            ring = [urls[(self._at + turn) % len(urls)] for turn in range(len(urls))]
            if several and method != "GET":
                ring = self._leader_first(ring, failed)
            for url in ring:
                try:
                    where, response = self._send(url, method, path, content, params,
                                                 content_type, timeout, request_id)  # fmt: skip
                except _NotSent as exc:
                    failed[url] = str(exc)
                    continue
                except _Unanswered as exc:
                    if method == "GET" or request_id is not None:
                        failed[url] = str(exc)
                        unanswered = None if method == "GET" else str(exc)
                        continue
                    raise MayHaveBeenMade(
                        f"{exc}; the change may have been made: look (a read) before sending "
                        "it again"
                    ) from exc.__cause__
                if (
                    response.status_code == 503
                    and b"this control plane follows" in response.content
                ):
                    try:
                        self._answer(answer, where, path, response)
                    except CtlError as refused:
                        failed[url] = str(refused)
                    continue
                if url in urls:
                    self._at = urls.index(url)
                return self._answer(answer, where, path, response)
            if time.monotonic() + ROUND_PAUSE_S >= deadline:
                if unanswered is not None:
                    raise MayHaveBeenMade(unanswered)
                if not several:
                    raise Unreachable(failed[urls[0]] if urls else "no admin API given")
                raise Unreachable(
                    f"no admin API answered within {self.follow_for:.0f}s: "
                    + "; ".join(failed.values())
                )
            time.sleep(ROUND_PAUSE_S)

    def _leader_first(self, ring: list[str], failed: dict[str, str]) -> list[str]:
        """Where to send a change: every admin API asked at once who leads (its status,
        within ASK_S); the leader first, then the others that answered, in `ring`'s order.
        One that did not answer is left out (its failure noted in `failed`): frozen, it would
        take the change and never answer, and a change sent is never sent again."""
        with ThreadPoolExecutor(max_workers=len(ring)) as pool:
            said = list(pool.map(self._who_leads, ring))
        claims = [c for c in said if isinstance(c, Claim)]
        for url, c in zip(ring, said, strict=True):
            if isinstance(c, str):
                failed[url] = c
        leader = leader_of(claims)
        answered = [c.asked for c in claims]
        if leader is None:
            return answered
        return [leader, *(u for u in answered if u != leader)]

    def _who_leads(self, url: str) -> Claim | str:
        """What `url` says of who leads, or why it said nothing."""
        try:
            _, response = self._send(url, "GET", "/v1/status", None, None, "application/json",
                                     httpx.Timeout(ASK_S, connect=ASK_S))  # fmt: skip
            status = self._answer(admin.StatusAnswer, url, "/v1/status", response)
        except CtlError as exc:
            return str(exc)
        if status.leading:
            return Claim(url, True, status.lease_epoch, url)
        named = next((p.admin_url for p in status.control_planes if p.leads), None)
        named = named.rstrip("/") if named else None
        return Claim(url, False, status.lease_epoch, named)

    def _send(
        self,
        url: str,
        method: str,
        path: str,
        content: bytes | None,
        params: dict[str, str] | None,
        content_type: str,
        timeout: float | httpx.Timeout,
        request_id: str | None = None,
    ) -> tuple[str, httpx.Response]:
        """One request to `url`, and on to the leader a follower names (307): where it was
        answered, and the answer. `_NotSent` when no connection was made (nothing was taken),
        `_Unanswered` when one was and no answer came."""
        headers = {"authorization": f"Bearer {self.target.token}", "content-type": content_type}
        if request_id is not None:
            headers[admin.IDEMPOTENCY_KEY] = request_id
        verify = self._verify if self._verify is not None else True
        try:
            response = httpx.request(
                method, url + path, content=content, params=params, headers=headers,
                timeout=timeout, verify=verify,
            )  # fmt: skip
            location = response.headers.get("location")
            if response.status_code == 307 and location:
                url = location.removesuffix(path)
                response = httpx.request(
                    method, location, content=content, params=params, headers=headers,
                    timeout=timeout, verify=verify,
                )  # fmt: skip
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _NotSent(f"cannot reach the admin API at {url}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise _Unanswered(f"no answer from the admin API at {url}: {exc}") from exc
        return url, response

    def _answer(
        self, answer: type[Answer], url: str, path: str, response: httpx.Response
    ) -> Answer:
        if response.status_code == 401:
            raise CtlError(f"the admin API at {url} refused the token (401)")
        self._replayed = response.headers.get(admin.REPLAYED) == "true"
        if response.status_code != 200:
            trouble: type[CtlError] = CtlError
            try:
                error = admin.ErrorAnswer.model_validate_json(response.content)
            except ValidationError:
                detail = response.text[:200]
            else:
                if error.problems is not None:
                    raise CatalogRefused(error.error, error.problems)
                detail = error.error
                if error.may_have_been_made:
                    trouble = MayHaveBeenMade
            if response.status_code >= 500 and trouble is CtlError:
                trouble = ServerTrouble
            raise trouble(f"{url}{path} answered {response.status_code}: {detail}")
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise CtlError(
                f"{url}{path} answered something ctl cannot read "
                f"(is the control plane of another version?): {exc.error_count()} problem(s)"
            ) from exc

    def _change(
        self,
        answer: type[Answer],
        method: str,
        path: str,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Answer:
        """A change made at most once, by its request id: sent again with the same id while
        its outcome is not known, for up to `retry_for` seconds; ctl says which attempt made
        it (or that none did) when it was sent more than once."""
        rid = os.environ.get(REQUEST_ID_ENV) or uuid.uuid4().hex
        deadline = time.monotonic() + self.retry_for
        unknown: str | None = None  # why the last attempt's outcome was not known
        while True:
            self._replayed = False
            try:
                made = self._call(answer, method, path, content, params, content_type, rid)
            except (MayHaveBeenMade, ServerTrouble, Unreachable) as exc:
                if not isinstance(exc, MayHaveBeenMade) and unknown is None:
                    raise  # refused before anything was sent to the store: nothing was made
                unknown = str(exc) if isinstance(exc, MayHaveBeenMade) else unknown
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise MayHaveBeenMade(
                        f"{unknown}\nthe change may have been made (request id {rid}; sent "
                        f"for {self.retry_for:.0f}s): look (a read), or ask again with "
                        f"{REQUEST_ID_ENV}={rid} and the same command: it is made at most once"
                    ) from None
                time.sleep(RETRY_PAUSE_S)
                continue
            except CtlError as exc:
                if self._replayed:
                    raise CtlError(
                        f"made by the earlier attempt (request id {rid}): {exc}"
                    ) from None
                if unknown is not None:
                    raise type(exc)(f"not made (request id {rid}): {exc}") from None
                raise
            if unknown is not None:
                self.say(
                    f"made by the earlier attempt (request id {rid}), whose answer said it may "
                    "have been"
                    if self._replayed
                    else f"made by this attempt (request id {rid}); the earlier one was not"
                )
            return made

    def nodes(self) -> admin.NodesAnswer:
        return self._call(admin.NodesAnswer, "GET", "/v1/nodes")

    def delete_node(self, node: str, force: bool) -> admin.NodeDeleted:
        params = {"force": "true"} if force else None
        path = f"/v1/nodes/{quote(node, safe='')}"
        return self._call(admin.NodeDeleted, "DELETE", path, params=params)

    def revoke_node(self, node: str) -> admin.NodeRevoked:
        path = f"/v1/nodes/{quote(node, safe='')}/revoke"
        return self._call(admin.NodeRevoked, "POST", path)

    def join_tokens(self) -> admin.JoinTokensAnswer:
        return self._call(admin.JoinTokensAnswer, "GET", "/v1/join-tokens")

    def credentials(self) -> admin.CredentialsAnswer:
        return self._call(admin.CredentialsAnswer, "GET", "/v1/credentials")

    def create_join_token(self, request: admin.JoinTokenCreate) -> admin.JoinTokenCreated:
        body = request.model_dump_json(exclude_none=True).encode()
        return self._call(admin.JoinTokenCreated, "POST", "/v1/join-tokens", body)

    def revoke_join_token(self, token_id: str) -> admin.JoinTokenInfo:
        path = "/v1/join-tokens/" + quote(token_id, safe="")
        return self._call(admin.JoinTokenInfo, "DELETE", path)

    def mark(self, node: str, request: admin.MarkRequest) -> admin.MarkAnswer:
        path = f"/v1/nodes/{quote(node, safe='')}/mark"
        body = request.model_dump_json(exclude_none=True).encode()
        if request.dry_run:
            return self._call(admin.MarkAnswer, "POST", path, body)
        return self._change(admin.MarkAnswer, "POST", path, body)

    def replicas(self) -> admin.ReplicasAnswer:
        return self._call(admin.ReplicasAnswer, "GET", "/v1/replicas")

    def replica(self, replica_id: str) -> admin.ReplicaInfo:
        return self._call(admin.ReplicaInfo, "GET", "/v1/replicas/" + quote(replica_id, safe=""))

    def rebalance(self, model: str | None, dry_run: bool) -> admin.RebalanceAnswer:
        params = {"dry_run": "true" if dry_run else "false"}
        if model is not None:
            params["model"] = model
        return self._call(admin.RebalanceAnswer, "POST", "/v1/rebalance", params=params)

    def explain(self, model: str) -> admin.Explanation:
        return self._call(admin.Explanation, "GET", "/v1/explain/" + quote(model, safe=""))

    def catalog(self) -> admin.CatalogAnswer:
        return self._call(admin.CatalogAnswer, "GET", "/v1/catalog")

    def catalog_history(self, limit: int) -> admin.CatalogHistory:
        params = {"limit": str(limit)}
        return self._call(admin.CatalogHistory, "GET", "/v1/catalog/history", params=params)

    def apply_catalog(self, content: bytes, dry_run: bool) -> admin.CatalogChange:
        if dry_run:
            params = {"dry_run": "true"}
            return self._call(
                admin.CatalogChange, "PUT", "/v1/catalog", content, params, "application/yaml"
            )
        return self._change(
            admin.CatalogChange, "PUT", "/v1/catalog", content, None, "application/yaml"
        )

    def status(self) -> admin.StatusAnswer:
        return self._call(admin.StatusAnswer, "GET", "/v1/status")

    def routing(self) -> admin.RoutingAnswer:
        return self._call(admin.RoutingAnswer, "GET", "/v1/routing")

    def keys(self) -> admin.KeysAnswer:
        return self._call(admin.KeysAnswer, "GET", "/v1/keys")

    def create_key(self, request: admin.KeyCreate) -> admin.KeyCreated:
        body = request.model_dump_json(exclude_none=True).encode()
        return self._change(admin.KeyCreated, "POST", "/v1/keys", body)

    def update_key(self, name: str, request: admin.KeyUpdate) -> admin.KeyInfo:
        body = request.model_dump_json(exclude_unset=True).encode()
        return self._change(admin.KeyInfo, "PATCH", "/v1/keys/" + quote(name, safe=""), body)

    def revoke_key(self, name: str) -> admin.KeyInfo:
        return self._change(admin.KeyInfo, "DELETE", "/v1/keys/" + quote(name, safe=""))

    def logs(
        self,
        replica: str,
        shard: int,
        tail: int,
        previous: int,
        offset: int | None = None,
        since: str | None = None,
        run: str | None = None,
    ) -> admin.LogsAnswer:
        params = {"shard": str(shard), "tail": str(tail), "previous": str(previous)}
        if offset is not None:
            params["offset"] = str(offset)
            if run:
                params["run"] = run
        elif since is not None:
            params["since"] = since
        path = "/v1/logs/" + quote(replica, safe="")
        return self._call(admin.LogsAnswer, "GET", path, params=params)

    def events(
        self, regarding: str | None, since: str, after: int = 0, limit: int = 1000
    ) -> admin.EventsAnswer:
        params = {"since": since, "after": str(after), "limit": str(limit)}
        if regarding is not None:
            params["for"] = regarding
        return self._call(admin.EventsAnswer, "GET", "/v1/events", params=params)

    def usage(self, key: str | None, model: str | None, since: str) -> admin.UsageAnswer:
        params = {"since": since}
        if key is not None:
            params["key"] = key
        if model is not None:
            params["model"] = model
        return self._call(admin.UsageAnswer, "GET", "/v1/usage", params=params)
