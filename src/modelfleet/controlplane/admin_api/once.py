"""Changes made at most once, by request id: the `Idempotency-Key` header.

A change whose store call does not answer in time may still commit (PostgreSQL frozen 2 s
committed it once it woke), so it is answered 503 "may have been made" with its request id,
never "nothing was changed". The id is recorded in the same transaction as the change
(`store.Once`): sent again with the same id, the change is not made twice (its write is
refused, `AlreadyMade`; or it is refused as made already, a key of its name existing, and
the store is asked whether this id made it), and the answer says what the earlier attempt
did (`Idempotent-Replayed: true`). While the earlier attempt
still waits on the store, the answer is "may have been made" again. A request without the
header gets an id made here, said in the answer.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from modelfleet.controlplane.admin_api.shared import Refused, error
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.http.web import JSON
from modelfleet.messages import admin
from modelfleet.store import Once, OutcomeUnknown, StoredRequest

_VALID = re.compile(admin.REQUEST_ID_PATTERN)


def given_id(request: Request) -> str | None:
    """The request id the client sent (400 if it is malformed), or None."""
    given = request.headers.get(admin.IDEMPOTENCY_KEY)
    if given is not None and not _VALID.match(given):
        raise Refused.because(
            400,
            f"{admin.IDEMPOTENCY_KEY}: {given[:40]!r} is not a request id (1 to 128 letters, "
            "digits and . _ : -)",
        )
    return given


def request_id(request: Request) -> str:
    """This change's request id: the client's, or one made now; kept for the answers."""
    rid = given_id(request) or uuid.uuid4().hex
    request.state.request_id = rid
    return rid


def begin(cp: ControlPlane, request: Request, route: str, **outcome: Any) -> Once:
    """A change of `route` about to be made: its `Once` (with what is known of its outcome
    now). Its write records the request id, or is refused (AlreadyMade) when an earlier
    attempt did; OutcomeUnknown while an earlier attempt still waits on the store. No store
    I/O: a change goes to the store at once."""
    rid = request_id(request)
    if rid in cp.calls.in_flight:
        raise OutcomeUnknown("an earlier attempt of this request has had no answer from the store")
    return Once(rid, route, outcome)


async def earlier(cp: ControlPlane, request: Request) -> StoredRequest | None:
    """What an earlier attempt of this request made, if the client gave a request id and an
    attempt made it: asked when the change is refused, or changes nothing, because of what
    may be that attempt's doing (a key of its name exists, the catalog is the same)."""
    rid = given_id(request)
    return None if rid is None else await cp.calls(cp.store.request, rid)


def replayed(route: str, made: StoredRequest, answer: BaseModel) -> Response:
    """The answer to a request made before: `answer`, rebuilt from what it recorded."""
    same_route(route, made)
    body = answer.model_dump_json(exclude_none=True)
    return Response(body, media_type=JSON, headers=_replay_headers(made.id))


def refused_replay(route: str, made: StoredRequest, status: int, message: str) -> Response:
    """A request made before whose answer cannot be given again (a key's secret)."""
    same_route(route, made)
    answer = admin.ErrorAnswer(error=message, request_id=made.id)
    return error(status, answer, _replay_headers(made.id))


def same_route(route: str, made: StoredRequest) -> None:
    """422 when the request id was used for another change."""
    if made.route != route:
        raise Refused.because(
            422,
            f"{admin.IDEMPOTENCY_KEY} {made.id} was used for {made.route}, not {route}: "
            "give each change its own",
        )


def _replay_headers(rid: str) -> dict[str, str]:
    return {admin.REPLAYED: "true", admin.IDEMPOTENCY_KEY: rid}


def unknown(request: Request, exc: OutcomeUnknown) -> Response:
    """The answer to a change whose store call has no outcome yet: it may have been made."""
    rid: str | None = getattr(request.state, "request_id", None)
    if rid is None:  # a change not made by request id: looked at, not sent again blindly
        what = "look (a read) before sending it again"
        headers = {}
    else:
        what = (
            f"send it again with the header {admin.IDEMPOTENCY_KEY}: {rid} (ctl does): it is "
            "made at most once, and the answer says whether the earlier attempt made it"
        )
        headers = {admin.IDEMPOTENCY_KEY: rid}
    message = (
        f"{exc}; the change may have been made: the store has not said whether it committed "
        f"(request id {rid or 'none'}). If it did, the control plane acts on it as soon as the "
        f"store answers. To know, {what}"
    )
    answer = admin.ErrorAnswer(error=message, may_have_been_made=True, request_id=rid)
    return error(503, answer, {"retry-after": "1", **headers})
