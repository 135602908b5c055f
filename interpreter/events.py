"""An append-only log of text a state produced, read by sync and async streaming iterators alike."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class TextEvent:
    text: str
    var: str | None  # the variable this text belongs to (a gen or select), None for other text
    meta_info: dict | None = None
    done: bool = False  # marks the variable `var` as complete


class EventLog:
    def __init__(self) -> None:
        self.events: list[TextEvent] = []
        self.closed = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._waiters: list[Future] = []

    def append(self, event: TextEvent) -> None:
        with self._lock:
            self.events.append(event)
            self._wake()

    def close(self, error: BaseException | None = None) -> None:
        with self._lock:
            if not self.closed:
                self.closed, self.error = True, error
            self._wake()

    def wait_beyond(self, count: int) -> Future:
        """A future resolved once the log holds more than `count` events or is closed."""
        future: Future = Future()
        with self._lock:
            if len(self.events) > count or self.closed:
                future.set_result(None)
            else:
                self._waiters.append(future)
        return future

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            future.set_result(None)
