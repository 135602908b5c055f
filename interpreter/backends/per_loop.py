"""One client object per event loop: aiohttp sessions and httpx clients belong to the loop that made them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
CLOSE_TIMEOUT_S = 30.0


class PerLoop(Generic[T]):
    """`get()` returns this loop's object, made by `make()` on first use there; `close_all()` closes them all."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[None]]) -> None:
        self._make = make
        self._close = close
        self._objects: dict[asyncio.AbstractEventLoop, T] = {}
        self._lock = threading.Lock()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._objects if other.is_closed()]:
                del self._objects[stale]  # its loop is gone, and the object with it
            if loop not in self._objects:
                self._objects[loop] = self._make()
            return self._objects[loop]

    def close_all(self) -> None:
        """Close each object on its own loop, where that loop still runs; later get() calls make new ones."""
        with self._lock:
            objects = list(self._objects.items())
            self._objects.clear()
        for loop, obj in objects:
            if not loop.is_running():
                continue  # nothing can run the close
            if _running_loop() is loop:
                loop.create_task(self._close(obj))
            else:
                asyncio.run_coroutine_threadsafe(self._close(obj), loop).result(CLOSE_TIMEOUT_S)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
