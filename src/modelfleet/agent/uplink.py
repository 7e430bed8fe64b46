"""The agent's link to the control plane: which of several it talks to (the leader: it asks
them all at once who leads, at its start and whenever the one it talks to fails it, and goes
straight there; besides, by the redirects of followers and the lease epochs of the answers),
its reports and heartbeats, and
what it does when the control plane refuses it (say so once, join anew with the join token it
was given, wait longer after each refusal)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging

import httpx
from pydantic import ValidationError

from modelfleet.agent.credential import JoinFailed, Unreachable, forget_join_token, join
from modelfleet.agent.settings import AgentSettings
from modelfleet.core.leader import Claim, leader_of
from modelfleet.host.clock import wait_set
from modelfleet.messages.wire import (
    AgentReport,
    Heartbeat,
    HeartbeatAnswer,
    LeaderAnswer,
    LogAnswer,
    NodeAssignment,
    NodeUse,
)
from modelfleet.security.joining import BadJoinToken, JoinToken
from modelfleet.security.pki import PkiError

log = logging.getLogger("modelfleet.agent")

# With several control planes, one that does not answer in time is left for the next: it may be
# frozen, or cut off, and a new leader takes its lease within the lease's TTL (3 s by default).
# With one, there is nowhere else to go: it is given the time a busy one may need (a restart at
# 10,000 nodes answers thousands of reports at once).
PATIENCE_S = {"one": (10.0, 10.0), "several": (1.0, 3.0)}  # to connect, to answer
# How much longer than the interval the control plane holds a heartbeat it is waited for.
HOLD_MARGIN_S = {"one": 10.0, "several": 1.0}
# Asking each control plane who leads: one that is frozen or cut off is given no longer.
ASK_S = 1.0
STANDING_IN = "x-modelfleet-standing-in"  # a leader whose store is down answered
REFUSED_WAIT_MAX_S = 60.0  # the longest wait between tries while the control plane refuses it


class Beat(enum.Enum):
    """Why a heartbeat has no answer."""

    CHANGED = "something changed: report it instead"
    REPORT = "the control plane asks for the whole report"
    FAILED = "it failed: try again after a while"


class Uplink:
    """One agent's exchanges with the control plane. `changed` is set when something the
    agent reports changed: a heartbeat under way is given up for a report, and a wait ends."""

    def __init__(self, settings: AgentSettings, boot_id: str, changed: asyncio.Event) -> None:
        self.settings = settings
        self.boot_id = boot_id
        self._changed = changed
        headers = {"authorization": f"Bearer {settings.token}"} if settings.token else {}
        self._urls = settings.control_planes or (settings.control_plane,)
        self._at = 0  # the control plane it talks to now, in `_urls`
        # With several: ask them all who leads before the next exchange, at the start
        # (`_ask_first`) and once the one it talks to failed it or answered under an old
        # epoch (`_lost`).
        self._ask_first = len(self._urls) > 1
        self._lost = False
        self.epoch = 0  # the highest lease epoch of a leader it has taken an answer from
        self._how_many = "several" if len(self._urls) > 1 else "one"
        self._cp = httpx.AsyncClient(
            base_url=settings.control_plane,
            headers=headers,
            timeout=httpx.Timeout(
                PATIENCE_S[self._how_many][1], connect=PATIENCE_S[self._how_many][0]
            ),
            verify=settings.verify if settings.verify is not None else True,
            transport=settings.transport,
        )
        self._refusal: str | None = None  # why the control plane refuses this agent, as said
        self._refusals = 0  # refusals in a row: each waits longer
        self._join_tried = False  # with the join token it holds (it is tried once)

    async def aclose(self) -> None:
        await self._cp.aclose()

    @property
    def control_plane(self) -> str:
        """The control plane this agent talks to now."""
        return self._urls[self._at]

    def _next_control_plane(self) -> None:
        """Talk to the next control plane: none of them named a leader (an election goes on,
        or the store is down). A new one asks for the whole report, by its answer to a
        heartbeat."""
        if len(self._urls) < 2:
            return
        self._talk_to((self._at + 1) % len(self._urls))
        log.info("talking to the control plane at %s now", self._urls[self._at])

    def _talk_to(self, at: int) -> None:
        self._at = at
        self._cp.base_url = httpx.URL(self._urls[at])

    async def _find_leader(self) -> None:
        """Ask every control plane it knows, at once, who leads (ASK_S each: one frozen or
        cut off costs no more), and talk to the leader (`core.leader.leader_of`). When none
        names one: to the next, if the one it talks to failed it."""
        failed, self._lost, self._ask_first = self._lost, False, False
        if len(self._urls) < 2:
            return
        answers = await asyncio.gather(*(self._ask(url) for url in self._urls))
        found = leader_of((a for a in answers if a is not None), self.epoch)
        if found is None:
            if failed:
                self._next_control_plane()
            return
        if found not in self._urls:  # a leader not on the command line: kept, after them
            self._urls = (*self._urls, found)
        at = self._urls.index(found)
        if at != self._at:
            self._talk_to(at)
            log.info("the leader is at %s: talking to it now", found)

    async def _ask(self, url: str) -> Claim | None:
        """Who `url` says leads; None when it does not answer in time, or answers no."""
        try:
            response = await self._cp.get(
                url + "/v1/leader", timeout=httpx.Timeout(ASK_S, connect=ASK_S)
            )
            if response.status_code != 200:
                log.info("%s does not say who leads (%d)", url, response.status_code)
                return None
            said = LeaderAnswer.model_validate_json(response.content)
        except httpx.HTTPError as exc:
            log.info("%s does not say who leads: %s", url, describe(exc))
            return None
        except ValidationError:
            return None
        named = said.leader_url.rstrip("/") if said.leader_url else None
        return Claim(url, said.leading, said.epoch, url if said.leading else named)

    def _follow(self, response: httpx.Response) -> bool:
        """A follower's 307 names the leader: talk to it from now on. False when the answer
        names no location."""
        location = response.headers.get("location")
        if not location:
            return False
        target = httpx.URL(location)
        base = str(target.copy_with(path="/", query=None, fragment=None)).rstrip("/")
        if base not in self._urls:  # a leader not on the command line: kept, after them
            self._urls = (*self._urls, base)
        self._at = self._urls.index(base)
        self._cp.base_url = httpx.URL(base)
        log.info("%s follows; talking to the leader at %s now", response.url.host, base)
        return True

    def _standing_in(self, response: httpx.Response) -> None:
        """The leader answered while its store is down: it holds no lease it can renew, and
        another may have taken it. Who leads is asked again before the next exchange."""
        if response.headers.get(STANDING_IN) and len(self._urls) > 1:
            self._ask_first = True

    def took_epoch(self, epoch: int) -> bool:
        """Whether an answer of a leader under lease `epoch` may be taken: not when the agent
        has seen a newer leader (this one lost its lease and does not know yet)."""
        if epoch < self.epoch:
            log.warning(
                "refused an assignment of epoch %d from %s: a leader of epoch %d has answered "
                "before",
                epoch,
                self.control_plane,
                self.epoch,
            )
            self._lost = True
            return False
        if epoch > self.epoch:
            log.info("the leader at %s answers under epoch %d", self.control_plane, epoch)
            self.epoch = epoch
        return True

    async def send_report(self, report: AgentReport) -> NodeAssignment | None:
        """One exchange with the control plane; None when it failed (logged, retried later).
        Sent again at once to the leader a follower names, and, with several control planes,
        to the leader they name when one cannot be reached (each once): the one it talked to
        may be a leader killed, whose successor then waited for the agent's next try to
        settle."""
        body, unreached = report.model_dump_json(), 0
        for _ in range(2 * len(self._urls) + 1):
            if self._lost or self._ask_first:
                await self._find_leader()
            try:
                response = await self._cp.post("/v1/report", content=body)
            except httpx.HTTPError as exc:
                log.warning("report to %s failed: %s", self.control_plane, describe(exc))
                self._lost = True
                unreached += 1
                if unreached >= len(self._urls):
                    return None
                continue
            if response.status_code != 307 or not self._follow(response):
                break
        if response.status_code in (401, 403):
            await self._refused(response)
            return None
        if response.status_code != 200:
            log.warning("control plane refused report %d: %s", report.seq, response.text[:300])
            if response.status_code == 503:
                self._lost = True
            return None
        self._accepted()
        self._standing_in(response)
        try:
            assignment = NodeAssignment.model_validate_json(response.content)
        except ValidationError as exc:
            log.warning("control plane answered with no assignment: %s", exc)
            return None
        return assignment if self.took_epoch(assignment.epoch) else None

    async def _refused(self, response: httpx.Response) -> None:
        """The control plane refuses this agent's token or credential (401), or what its
        report says (403: another node's name, an address its node may not advertise): say
        so once, clearly; after a 401, join anew when a join token was given that was not
        tried yet; and wait longer after each refusal in a row (up to REFUSED_WAIT_MAX_S), so
        that a refused node neither floods its log nor the control plane."""
        why = _error_of(response)
        if why != self._refusal:
            log.error(
                "the control plane at %s refuses this agent: %s. Nothing it sends is taken; "
                "its engines keep running.",
                self.control_plane,
                why,
            )
            self._refusal = why
        token = self.settings.join_token.token
        if response.status_code == 401 and token is not None and not self._join_tried:
            self._join_tried = True
            if await self._join_anew(token):
                return
        self._refusals += 1
        wait = min(REFUSED_WAIT_MAX_S, self.settings.report_interval * 2**self._refusals)
        await wait_set(self._changed, wait)

    async def _join_anew(self, token: str) -> bool:
        """Join again with `token`, taking the new credential; whether it joined."""
        s = self.settings
        try:
            parsed = JoinToken.parse(token)
            joined = await asyncio.to_thread(
                join, s.control_plane, parsed, s.node, [s.address], s.state_dir
            )
        except (BadJoinToken, JoinFailed, Unreachable, PkiError, OSError) as exc:
            log.error("cannot join anew with the join token given: %s", exc)
            return False
        joined.tls_files(s.state_dir)  # new certificates: the engines started from now use them
        joined.ca_file(s.state_dir)
        self.settings = dataclasses.replace(s, token=joined.credential)
        self._cp.headers["authorization"] = f"Bearer {joined.credential}"
        self._refusal, self._refusals = None, 0
        log.info("joined anew as node %s with the join token given", s.node)
        forget_join_token(self.settings.join_token)
        return True

    def _accepted(self) -> None:
        """The control plane takes what this agent sends (again): a join token it holds is
        needed no more."""
        if self._refusal is not None:
            log.info("the control plane at %s takes this agent's reports again",
                     self.control_plane)  # fmt: skip
        self._refusal, self._refusals = None, 0
        forget_join_token(self.settings.join_token)

    async def send_log(self, answer: LogAnswer) -> None:
        """An answer to the control plane's request for an engine's log (`ctl logs`)."""
        try:
            await self._cp.post("/v1/logs", content=answer.model_dump_json())
        except httpx.HTTPError as exc:
            log.warning("log answer to %s failed: %s", self.control_plane, describe(exc))

    async def send_heartbeat(
        self, seq: int, held: NodeAssignment, use: NodeUse
    ) -> HeartbeatAnswer | Beat:
        """One heartbeat: its answer, or why there is none. It is given up when something
        changes meanwhile, so that the change is reported at once."""
        if self._lost or self._ask_first:
            await self._find_leader()
        beat = Heartbeat(
            node=self.settings.node,
            boot_id=self.boot_id,
            seq=seq,
            assignment=held.version,
            use=use,
        )
        # The control plane holds the answer up to one interval: wait a little longer.
        connect, within = PATIENCE_S[self._how_many]
        read = held.heartbeat_interval + HOLD_MARGIN_S[self._how_many]
        timeout = httpx.Timeout(within, connect=connect, read=read)
        sent = asyncio.ensure_future(
            self._cp.post("/v1/heartbeat", content=beat.model_dump_json(), timeout=timeout)
        )
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({sent, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            if not sent.done():
                sent.cancel()
        if not sent.done() or sent.cancelled():
            return Beat.CHANGED
        try:
            response = sent.result()
        except httpx.HTTPError as exc:
            log.warning("heartbeat to %s failed: %s", self.control_plane, describe(exc))
            self._lost = len(self._urls) > 1
            # With several, the whole report to the leader at once (it asks for it anyway).
            return Beat.REPORT if len(self._urls) > 1 else Beat.FAILED
        if response.status_code == 409:  # it holds no report of this run: send one
            log.info("control plane asks for the whole report: %s", response.text[:300])
            return Beat.REPORT
        if response.status_code == 307 and self._follow(response):
            return Beat.REPORT  # to the leader, at once
        if response.status_code == 401:
            await self._refused(response)
            return Beat.REPORT
        if response.status_code != 200:
            log.warning("control plane refused heartbeat %d: %s", seq, response.text[:300])
            if response.status_code == 503:
                self._lost = True
            return Beat.FAILED
        self._standing_in(response)
        try:
            answer = HeartbeatAnswer.model_validate_json(response.content)
        except ValidationError as exc:
            log.warning("control plane answered a heartbeat with nonsense: %s", exc)
            return Beat.FAILED
        return answer if self.took_epoch(answer.epoch) else Beat.FAILED


def _error_of(response: httpx.Response) -> str:
    """The error a control plane's answer carries, or its text."""
    try:
        said = response.json().get("error")
    except (ValueError, AttributeError):
        said = None
    return str(said) if said else response.text.strip()[:300]


def describe(exc: httpx.HTTPError) -> str:
    """Why an exchange failed, never empty: httpx's timeouts carry no message."""
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
