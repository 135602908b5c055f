"""The caller's end of the scheduler process: the connection both ways (writes through the outbox's sender thread,
so no caller blocks on a busy scheduler), the receiver thread that folds each output into its request's state, the
scheduler's latest load report, and control calls waiting for their answers. A scheduler that dies (or a connection
that breaks) fails every request and call in flight at once, and the link refuses new ones."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from ..wire.finish_reason import FinishReason
from ..wire.messages import AbortReq, LoadReport, ReqOutput, RpcOut, RpcReq, SchedulerError, SchedulerReady
from .outbox import Outbox
from .request_state import RequestState


class SchedulerLink:
    def __init__(self, process: subprocess.Popen, conn: Connection, pending_limit: int) -> None:
        self.process, self.conn = process, conn
        self.outbox = Outbox(conn, pending_limit, self._broken)
        self.load: dict[str, Any] = {}  # the scheduler's counters after its latest step (SchedulerReady, LoadReport)
        self.lock = threading.Lock()  # guards states and rpc_waiters (the receiver thread and callers share them)
        self.states: dict[str, RequestState] = {}
        self.rpc_waiters: dict[int, Future] = {}
        self.call_ids = itertools.count()
        self.closed = False
        self.dead: Exception | None = None  # set once the scheduler process or its connection is gone
        # Called (on the receiver thread) with each request's RequestState when it ends: the server's metrics.
        self.observers: list[Callable[[RequestState], None]] = []
        self.receiver = threading.Thread(target=self._receive_loop, daemon=True, name="furcate-receiver")

    def start(self) -> None:
        """Start both threads, once the scheduler is ready (what came before went through `conn` directly)."""
        self.outbox.start()
        self.receiver.start()

    def wait_ready(self, timeout: float) -> SchedulerReady:
        try:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"scheduler did not start within {timeout}s")
            message = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"scheduler process exited with code {self.process.wait()} during start-up") from None
        if isinstance(message, SchedulerError):
            raise RuntimeError(f"scheduler failed to start:\n{message.message}")
        self.load = message.load
        return message

    def check_serving(self) -> None:
        if self.closed:
            raise RuntimeError("engine is shut down")
        if self.dead is not None:
            raise RuntimeError(f"engine cannot serve: {self.dead}")

    def submit(self, state: RequestState) -> None:
        """Track a request's state, then send the request."""
        self.check_serving()
        with self.lock:
            if state.req.rid in self.states:
                raise ValueError(f"rid {state.req.rid!r} is already in flight")
            self.states[state.req.rid] = state
        try:
            self.outbox.put_request(state.req.rid, state.req)
        except BaseException:
            with self.lock:
                self.states.pop(state.req.rid, None)
            raise

    def abandon(self, state: RequestState) -> None:
        """Nobody waits for this request any more: forget it here (later outputs are dropped) and abort it."""
        with self.lock:
            self.states.pop(state.req.rid, None)
        self.observe(state)
        self.abort(state.req.rid)

    def abort(self, rid: str) -> None:
        """Abort one request: one still in the outbox is withdrawn and ends here as the scheduler would end it."""
        if self.outbox.withdraw(rid):
            self._dispatch(aborted(rid))
        elif self.dead is None and not self.closed:
            self.outbox.put_control(AbortReq(rid))

    def withdraw_all(self) -> None:
        """End every request the scheduler has not received yet (abort_all: it aborts the ones it has)."""
        for rid in self.outbox.withdraw_all():
            self._dispatch(aborted(rid))

    def in_flight(self) -> list[str]:
        with self.lock:
            return list(self.states)

    def rpc(self, call: Any, timeout: float) -> Any:
        """A control call (wire/control_calls.py, wire/weight_messages.py) answered by the scheduler."""
        if self.dead is not None:
            raise RuntimeError(f"engine cannot serve: {self.dead}")
        future: Future = Future()
        call_id = next(self.call_ids)
        with self.lock:
            self.rpc_waiters[call_id] = future
        try:
            self.outbox.put_control(RpcReq(call, call_id))
        except BaseException:
            with self.lock:
                self.rpc_waiters.pop(call_id, None)
            raise
        try:
            return future.result(timeout=timeout)
        finally:
            with self.lock:  # timed out: an answer that comes later has nobody to go to
                self.rpc_waiters.pop(call_id, None)

    def close(self, why: Exception) -> None:
        self.outbox.stop(timeout=5)
        self.conn.close()
        self.fail_all(why)

    def _receive_loop(self) -> None:
        while True:
            try:
                messages = self.conn.recv()
            except (EOFError, OSError):
                if not self.closed:
                    self._die(RuntimeError(f"scheduler process died (exit code {self.process.wait()})"))
                return
            if isinstance(messages, SchedulerError):
                self._die(RuntimeError(f"scheduler crashed:\n{messages.message}"))
                return
            for message in messages:
                try:
                    self._dispatch(message)
                except Exception as error:  # noqa: BLE001 - one request's failure must not stop the receiver
                    self._fail_one(getattr(message, "rid", None), error)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, RpcOut):
            self._answer(message)
            return
        if isinstance(message, LoadReport):
            self.load = message.counters
            return
        with self.lock:
            state = self.states.get(message.rid)
        if state is None:  # already aborted on this side
            return
        state.apply(message)
        if state.finished:
            with self.lock:
                self.states.pop(message.rid, None)
            self.observe(state)

    def _answer(self, message: RpcOut) -> None:
        with self.lock:
            future = self.rpc_waiters.pop(message.call_id, None)
        if future is None:
            return
        if isinstance(message.result, Exception):
            future.set_exception(message.result)
        else:
            future.set_result(message.result)

    def observe(self, state: RequestState) -> None:
        for observer in self.observers:
            with contextlib.suppress(Exception):  # metrics must never fail a request or stop the receiver
                observer(state)

    def _die(self, error: Exception) -> None:
        self.dead = error
        self.fail_all(error)

    def _broken(self, error: Exception) -> None:
        """The sender could not write: the scheduler's end is gone (the receiver sees it too, unless shutting down)."""
        if not self.closed and self.dead is None:
            self._die(RuntimeError(f"connection to the scheduler broke: {type(error).__name__}: {error}"))

    def _fail_one(self, rid: str | None, error: Exception) -> None:
        """A request whose output could not be processed (e.g. detokenized) fails alone and is aborted."""
        with self.lock:
            state = self.states.pop(rid, None) if rid is not None else None
        if state is not None:
            with contextlib.suppress(Exception):  # the receiver must survive whatever the sink does
                state.fail(RuntimeError(f"request {rid} failed while its output was processed: "
                                        f"{type(error).__name__}: {error}"))
            if self.dead is None and not self.closed:
                self.outbox.put_control(AbortReq(rid))

    def fail_all(self, error: Exception) -> None:
        with self.lock:
            states, self.states = list(self.states.values()), {}
            waiters, self.rpc_waiters = list(self.rpc_waiters.values()), {}
        for state in states:
            state.fail(error)
        for future in waiters:
            future.set_exception(error)


def aborted(rid: str) -> ReqOutput:
    """The output the scheduler gives a request aborted before it ran."""
    return ReqOutput(rid=rid, new_token_ids=[], finish_reason=FinishReason.abort("aborted by request"))
