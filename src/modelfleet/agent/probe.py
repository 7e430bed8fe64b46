"""A shard's engine asked over HTTP: its health probed, put to sleep or woken. Every call
carries the engine's key: some engines guard every route with it (llama-cpp-python's
server)."""

from __future__ import annotations

import httpx


class EngineHttp:
    """One engine, reached at `url` (on loopback behind a gate, else where it listens)."""

    def __init__(self, http: httpx.AsyncClient, url: str, key: str | None) -> None:
        self.http = http
        self.url = url
        self.headers = {"authorization": f"Bearer {key}"} if key else {}

    async def healthy(self, path: str, timeout: float = 2.0) -> bool:
        """Whether GET `path` answers 200 within `timeout`."""
        try:
            response = await self.http.get(self.url + path, timeout=timeout, headers=self.headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def post(self, path: str, timeout: float) -> str | None:
        """POST `path` (sleep and wake wait for what runs to end, and for the memory to be
        freed or filled); None when it answered 200, else why not."""
        try:
            answer = await self.http.post(self.url + path, headers=self.headers, timeout=timeout)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if answer.status_code == 200 else f"HTTP {answer.status_code}"

    async def sleeping(self) -> bool:
        """Whether the engine says it sleeps (vLLM's `/is_sleeping`)."""
        try:
            answer = await self.http.get(self.url + "/is_sleeping", headers=self.headers, timeout=5)
            return answer.status_code == 200 and answer.json().get("is_sleeping") is True
        except (httpx.HTTPError, ValueError):
            return False
