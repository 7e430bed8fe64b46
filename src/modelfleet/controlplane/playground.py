"""The dashboard's Playground: a chat with any model of the catalog (or one of its LoRA
adapters), streamed from the browser through the fleet's router with a client API key, to try
a model as its clients will meet it.

The browser cannot reach the router itself (another origin, and perhaps another host), so the
control plane relays each chat: `POST /ui/playground/chat` with the model, the messages and
the key goes to the first router of the config that names its `client_url`, streamed, and the
router's answer comes back as it is, with the replica that answered
(`x-modelfleet-replica`) and, when refused, why (`x-modelfleet-reason`). The key is the
browser's: pasted, or made here (`POST /ui/playground/key`: a key named `playground-...` that
expires in a day, KeyCreated like any other). Both need a signed-in session and a request
from the dashboard's own origin, as a mark does.
"""

from __future__ import annotations

import json
import secrets
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from modelfleet.controlplane.keys import KeyRefused
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.core.nesting import check_json
from modelfleet.http.web import from_elsewhere, read_at_most
from modelfleet.messages import admin
from modelfleet.security.pki import client_context

MAX_CHAT_BYTES = 256 * 1024
PLAYGROUND_KEY_LIFE = "1d"
PASSED_ON = ("x-modelfleet-replica", "x-modelfleet-reason", "retry-after", "x-request-id")


class Playground:
    """The Playground's page and its two calls."""

    def __init__(
        self,
        cp: ControlPlane,
        signed_in: Callable[[Request], bool],
        render: Callable[[str, dict[str, Any]], Response],
    ) -> None:
        self.cp = cp
        self.signed_in = signed_in
        self.render = render
        # A router serving TLS has a certificate of the fleet's CA, as its push listener does.
        self.verify: ssl.SSLContext | bool = client_context(cp.ca.cert_pem) if cp.ca else True

    def routes(self) -> list[Route]:
        return [
            Route("/playground", self.page),
            Route("/playground/key", self.make_key, methods=["POST"]),
            Route("/playground/chat", self.chat, methods=["POST"]),
        ]

    def models(self) -> list[str]:
        """What a chat may name: every model, and each adapter as `model:adapter`."""
        names = []
        for m in self.cp.catalogs.current.models:
            names.append(m.name)
            names += [f"{m.name}:{a.name}" for a in m.adapters]
        return names

    def _router(self) -> str | None:
        return next((r.client_url for r in self.cp.config.routers if r.client_url), None)

    async def page(self, request: Request) -> Response:
        if not self.signed_in(request):
            return Response(status_code=303, headers={"location": "/ui/login"})
        return self.render("playground.html", {"models": self.models(), "router": self._router()})

    def _refused(self, request: Request) -> Response | None:
        """401 without a session, 403 from another origin (what SameSite leaves to check)."""
        if not self.signed_in(request):
            return Response("sign in first\n", status_code=401)
        if from_elsewhere(request):
            return Response("a playground call must come from this dashboard\n", status_code=403)
        return None

    async def make_key(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        name = f"playground-{secrets.token_hex(3)}"
        try:
            key, stored = await self.cp.create_key(
                admin.KeyCreate(name=name, expires=PLAYGROUND_KEY_LIFE)
            )
        except KeyRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        return JSONResponse({"key": key, "name": stored.name, "expires": PLAYGROUND_KEY_LIFE})

    async def chat(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        router = self._router()
        if router is None:
            return JSONResponse(
                {
                    "error": "no router of this control plane's config names its client_url",
                    "unreachable": True,
                },
                status_code=503,
            )
        raw = await read_at_most(request, MAX_CHAT_BYTES)
        if raw is None:
            return JSONResponse({"error": f"a chat may have at most {MAX_CHAT_BYTES} bytes"}, 413)
        try:
            check_json(raw)  # TooDeep is a ValueError: refused as any body not taken
            asked = json.loads(raw)
            key, model, messages = asked["key"], asked["model"], asked["messages"]
            if not (isinstance(key, str) and isinstance(model, str) and isinstance(messages, list)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "send JSON: key, model and messages"}, 400)
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if isinstance(asked.get("max_tokens"), int):
            body["max_tokens"] = asked["max_tokens"]
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0), verify=self.verify)
        try:
            sent = client.build_request(
                "POST",
                f"{router}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
            )
            answer = await client.send(sent, stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            # `unreachable`: the page says it cannot reach the fleet, not that it was refused.
            why = str(exc) or type(exc).__name__
            return JSONResponse(
                {"error": f"the router at {router} did not answer: {why}", "unreachable": True},
                502,
            )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # also when the browser leaves: the router then cancels the request
                await answer.aclose()
                await client.aclose()

        headers = {h: answer.headers[h] for h in PASSED_ON if h in answer.headers}
        return StreamingResponse(
            relay(),
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type", "text/event-stream"),
            headers={**headers, "cache-control": "no-cache"},
        )
