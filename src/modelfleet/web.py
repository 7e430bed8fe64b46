"""HTTP pieces every modelfleet listener uses: JSON answers and the bearer-token check."""

from __future__ import annotations

import json
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

JSON = "application/json"


def json_response(data: Any, status: int = 200) -> Response:
    """`data` as a JSON answer."""
    return Response(json.dumps(data).encode(), status_code=status, media_type=JSON)


def error_response(status: int, message: str, **extra: Any) -> Response:
    """The error answer of modelfleet's own APIs (not the OpenAI one): `{"error": message}`."""
    return json_response({"error": message, **extra}, status)


def bearer_matches(authorization: str | None, token: str | None) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>`.

    Compared in constant time, so how long a refusal takes says nothing about the token.
    A missing token (None) matches nothing.
    """
    if token is None or authorization is None:
        return False
    return secrets.compare_digest(authorization.encode(), f"Bearer {token}".encode())


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
