"""Messages on their way to the scheduler process, written to its socket by one sender thread.

The scheduler reads its socket only between forward steps, so while it runs a long prefill the socket fills and a
write blocks. No caller may block there (the server's event loop would stop answering /health): callers put
messages here and return at once. Control messages (aborts, control calls) go ahead of new requests, so an abort
or /get_server_info never waits behind a backlog of prompts; new requests wait in a bounded queue, and a request
still here when it is aborted is withdrawn without ever reaching the scheduler. Each message is pickled by its
caller (as Connection.send would), so a message that cannot be sent fails there, for that caller alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any


class QueueFullError(RuntimeError):
    """The engine holds as many requests as it may (max_queued_requests, or max_pending_requests not yet taken by
    a busy scheduler); retry later. The server answers 503 with Retry-After."""


class Outbox:
    def __init__(self, conn: Connection, limit: int, on_broken: Callable[[Exception], None]) -> None:
        self.conn, self.limit, self.on_broken = conn, limit, on_broken
        self.ready = threading.Condition()
        self.control: deque[memoryview] = deque()
        self.requests: OrderedDict[str, memoryview] = OrderedDict()  # by rid
        self.stopped = False
        self.sender = threading.Thread(target=self._send_loop, daemon=True, name="furcate-sender")

    def start(self) -> None:
        self.sender.start()

    def put_control(self, message: Any) -> None:
        data = pickled(message)
        with self.ready:
            self.control.append(data)
            self.ready.notify()

    def put_request(self, rid: str, message: Any) -> None:
        data = pickled(message)
        with self.ready:
            if len(self.requests) >= self.limit:
                raise QueueFullError(f"the scheduler is busy and {len(self.requests)} requests already wait to reach "
                                     f"it (max_pending_requests={self.limit}); retry later")
            self.requests[rid] = data
            self.ready.notify()

    def withdraw(self, rid: str) -> bool:
        """Take back a request not yet sent; False when it is already with the scheduler (or unknown)."""
        with self.ready:
            return self.requests.pop(rid, None) is not None

    def withdraw_all(self) -> list[str]:
        """Take back every request not yet sent; their ids."""
        with self.ready:
            rids, self.requests = list(self.requests), OrderedDict()
        return rids

    def pending(self) -> int:
        with self.ready:
            return len(self.requests)

    def stop(self, timeout: float) -> None:
        """Stop sending (what is left is dropped) and wait for a send in progress to return."""
        with self.ready:
            self.stopped = True
            self.ready.notify()
        if self.sender.ident is not None:
            self.sender.join(timeout)

    def _next(self) -> memoryview | None:
        with self.ready:
            while not (self.stopped or self.control or self.requests):
                self.ready.wait()
            if self.stopped:
                return None
            if self.control:
                return self.control.popleft()
            return self.requests.popitem(last=False)[1]

    def _send_loop(self) -> None:
        while (data := self._next()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError) as error:  # the scheduler's end is gone (ValueError: closed here)
                self.on_broken(error)
                return


def pickled(message: Any) -> memoryview:
    return ForkingPickler.dumps(message)
