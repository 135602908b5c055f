"""One event loop, on one daemon thread, runs the nodes of every program state.

States never get a thread of their own: each state's nodes run as a task on this loop, and backends are
async, so many programs (and the children of a fork) have requests in flight at once and batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def interpreter_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="furcate-interpreter", daemon=True)
            _thread.start()
        return _loop


def on_interpreter_loop() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def call_soon(callback, *args: Any) -> None:
    interpreter_loop().call_soon_threadsafe(callback, *args)


def run_coroutine(coro: Coroutine) -> Future:
    return asyncio.run_coroutine_threadsafe(coro, interpreter_loop())
