"""HTTP pieces every modelfleet listener uses: JSON answers and the bearer-token check, as
Starlette responses and, for the paths served as bare ASGI, as ASGI messages."""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

JSON = "application/json"


def json_response(data: Any, status: int = 200) -> Response:
    """`data` as a JSON answer."""
    return Response(json.dumps(data).encode(), status_code=status, media_type=JSON)


def error_response(status: int, message: str, **extra: Any) -> Response:
    """The error answer of modelfleet's own APIs (not the OpenAI one): `{"error": message}`."""
    return json_response({"error": message, **extra}, status)


def from_elsewhere(request: Request) -> bool:
    """Whether a browser sent `request` from a page of another origin: what a session
    cookie's SameSite=Strict leaves to check on a change (a request with no Origin header
    is not a browser's cross-site one)."""
    origin = request.headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != request.headers.get("host")


def bearer_matches(authorization: str | None, token: str | None) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>`.

    Compared in constant time, so how long a refusal takes says nothing about the token.
    A missing token (None) matches nothing.
    """
    if token is None or authorization is None:
        return False
    return secrets.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    if authorization is None or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer ") :]


async def read_at_most(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is known to be longer than `limit` bytes
    (by its Content-Length, or while it streams in): nothing past the limit is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def header(scope: Scope, name: bytes) -> str | None:
    """The value of header `name` (lower case) of an ASGI request, if it has one."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def receive_at_most(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """An ASGI request's body, or None as soon as it is known to be longer than `limit`
    bytes: `read_at_most` without Starlette's request object."""
    declared = header(scope, b"content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


async def send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer an ASGI request with the JSON `body` (and `extra` headers)."""
    headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_json(message: str) -> bytes:
    """The body of `error_response`."""
    return json.dumps({"error": message}).encode()
