"""The scheduler's control calls (RpcReq): each answered by the handler registered for the call's type
(wire/control_calls.py, wire/weight_messages.py) by the scheduler itself (stats.py) or a plug-in (the RL calls:
generation_control.py, weight_sync.py).

A handler takes the call and returns its answer, or a Deferred when the answer must wait for the loop (requests
aborted a moment ago still settling): the loop polls it each round and answers when it is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...wire.messages import RpcOut, RpcReq

NOT_YET = object()
Handler = Callable[[Any], Any]


@dataclass
class Deferred:
    """An answer the loop polls for: poll() returns NOT_YET until it is known (or raises, answering the error)."""

    poll: Callable[[], Any]


class SchedulerRpc:
    """Answers each RpcReq by its call's type; a call it does not know is answered with the error, not raised (a
    bad call must not take the scheduler down)."""

    def __init__(self, handlers: dict[type, Handler]) -> None:
        self.handlers = handlers
        self.deferred: list[tuple[int, Deferred]] = []

    def answer(self, message: RpcReq) -> RpcOut | None:
        """The call's answer now, or None when it was deferred (advance() sends it)."""
        handler = self.handlers.get(type(message.call))
        if handler is None:
            return RpcOut(message.call_id, ValueError(f"unknown RPC method {message.call!r}"))
        result = self._run(lambda: handler(message.call))
        if isinstance(result, Deferred):
            self.deferred.append((message.call_id, result))
            return None
        return RpcOut(message.call_id, result)

    def advance(self) -> list[RpcOut]:
        """Answers of deferred calls that became known."""
        answered, waiting = [], []
        for call_id, deferred in self.deferred:
            result = self._run(deferred.poll)
            if result is NOT_YET:
                waiting.append((call_id, deferred))
            else:
                answered.append(RpcOut(call_id, result))
        self.deferred = waiting
        return answered

    @staticmethod
    def _run(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - a bad call is answered with its error; the loop goes on
            return error
