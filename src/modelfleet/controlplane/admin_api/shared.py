"""What every resource of the admin API shares: the refusal, the one shape of an error answer
(`{"error": ...}`, also for malformed requests, unknown paths and store failures), request
bodies read with a bound, and the document that says so."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute, Match

from modelfleet.core.catalog import Catalog
from modelfleet.core.nesting import TooDeep, check_json
from modelfleet.core.units import DURATION_PATTERN, BadDuration, parse_duration
from modelfleet.http.web import JSON, read_at_most
from modelfleet.messages import admin
from modelfleet.store import StoreError


class Refused(Exception):
    """An admin request refused: the status and the `ErrorAnswer` sent back."""

    def __init__(self, status: int, answer: admin.ErrorAnswer) -> None:
        super().__init__(answer.error)
        self.status = status
        self.answer = answer

    @classmethod
    def because(cls, status: int, message: str) -> Refused:
        return cls(status, admin.ErrorAnswer(error=message))


Body = TypeVar("Body", bound=BaseModel)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route documents: 401 and 429 (every route is behind the token,
    whose wrong guesses are throttled: `token.py`) and these."""
    return {status: {"model": admin.ErrorAnswer} for status in (401, 429, *statuses)}


def body_of(model: type[BaseModel]) -> dict[str, Any]:
    """The request body a route documents: it reads the body itself (see `read_body`)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def error(
    status: int, answer: admin.ErrorAnswer, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer. Encoded by the json module, which writes what it echoes of the
    request (a lone surrogate in a catalog, say) as escapes where pydantic's encoder fails."""
    body = json.dumps(answer.model_dump(exclude_none=True))
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def problems(found: Sequence[Mapping[str, Any]]) -> str:
    """pydantic's errors in one line: `field: what is wrong; ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in found)


async def read_body(request: Request, model: type[Body], limit: int) -> Body:
    """The request's body as a `model`, read as JSON whatever its Content-Type says (`curl -d`
    sends a form type); 413 past `limit` bytes, 400 naming every problem (or the nesting
    limit, `nesting.py`)."""
    raw = await read_at_most(request, limit)
    if raw is None:
        raise Refused.because(413, f"a request may have at most {limit} bytes")
    try:
        check_json(raw)
    except TooDeep as exc:
        raise Refused.because(400, f"malformed request: {exc}") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise Refused.because(400, f"malformed request: {problems(exc.errors())}") from None


def duration(name: str, text: str, otherwise: str = "", clamp: bool = False) -> float:
    """A duration parameter (90m, 24h, 7d) in seconds, or 400 naming the parameter (and
    what `otherwise` it may be); `clamp`: `parse_duration`'s."""
    try:
        return parse_duration(text, clamp)
    except BadDuration as exc:
        raise Refused.because(400, f"{name}: {exc}{otherwise}") from None


# A `since` query parameter: how far back to look, a duration as the document states it
# (`units.DURATION_PATTERN`), read by `duration(..., clamp=True)`, which says what is wrong
# with one that is not: one longer than 100 years looks back 100 years, so that nothing
# the document allows is refused.
Since = Query(
    description="A duration: 90s, 10m, 24h, 7d, 2w.",
    json_schema_extra={"pattern": DURATION_PATTERN},
)


def no_such_model(catalog: Catalog, model: str) -> Refused:
    known = ", ".join(m.name for m in catalog.models) or "none"
    return Refused.because(404, f"model {model!r} is not in the current catalog (models: {known})")


def answer_errors(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """Every failure `app` (serving `routes`) meets answered as an `ErrorAnswer`, and
    documented as one."""

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> Response:
        return error(exc.status, exc.answer)

    @app.exception_handler(StoreError)
    async def cannot_write(_: Request, exc: StoreError) -> Response:
        """A change the store refused (a full disk, a store that cannot be reached, a read
        that did not answer): nothing was changed. One whose outcome is not known is
        answered otherwise (`once.unknown`)."""
        message = (
            f"{exc}; nothing was changed. The control plane goes on serving and recovers by "
            "itself once its store can write again: try again then"
        )
        return error(503, admin.ErrorAnswer(error=message), {"retry-after": "10"})

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, exc: RequestValidationError) -> Response:
        found = problems([{**e, "loc": e["loc"][1:]} for e in exc.errors()])
        return error(400, admin.ErrorAnswer(error=f"malformed request: {found}"))

    @app.exception_handler(StarletteHTTPException)
    async def unrouted(request: Request, exc: StarletteHTTPException) -> Response:
        """A path no route matches, or a method it does not take, as an `ErrorAnswer`."""
        what = {404: "no such path", 405: "method not allowed on"}.get(exc.status_code, "")
        message = f"{what} {request.method} {request.url.path}" if what else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            # Each method of a path is a route of its own: Allow names those of all of them.
            # (`routes`, not `app.routes`: FastAPI keeps an included router's routes apart.)
            methods = {
                method
                for route in routes
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE
                for method in route.methods or ()
            }
            headers = {"allow": ", ".join(sorted(methods))}
        return error(exc.status_code, admin.ErrorAnswer(error=message), headers)

    def document() -> dict[str, Any]:
        """FastAPI's document, saying what this API answers to a malformed request: 400 with
        an ErrorAnswer (see `malformed`), not FastAPI's own 422."""
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schema = {"$ref": "#/components/schemas/ErrorAnswer"}
            for operations in doc["paths"].values():
                for operation in operations.values():
                    answers = operation["responses"]
                    default = answers.get("422", {}).get("content", {}).get("application/json")
                    if default and default["schema"]["$ref"].endswith("/HTTPValidationError"):
                        del answers["422"]
                        answers["400"] = {
                            "description": "Malformed request",
                            "content": {"application/json": {"schema": schema}},
                        }
            for unused in ("HTTPValidationError", "ValidationError"):
                doc["components"]["schemas"].pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
