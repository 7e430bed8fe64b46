"""Driving the control plane's async parts from tests written step by step."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


class Awaited:
    """`target`, with each of its coroutine methods run to its end when called."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *args, **kwargs: asyncio.run(attr(*args, **kwargs))
        return attr
