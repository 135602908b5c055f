"""The scheduler's control calls (RpcReq methods): statistics, cache flush, the KV integrity check, and what
plug-ins add (the RL calls: weight_sync.py).

A handler takes the call's payload and returns its answer, or a Deferred when the answer must wait for the loop
(requests aborted a moment ago still settling): the loop polls it each round and answers when it is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...wire.messages import RpcOut, RpcReq

if TYPE_CHECKING:
    from ..scheduler import Scheduler


NOT_YET = object()
Handler = Callable[[Any], Any]


@dataclass
class Deferred:
    """An answer the loop polls for: poll() returns NOT_YET until it is known (or raises, answering the error)."""

    poll: Callable[[], Any]


class SchedulerRpc:
    """Answers each RpcReq by method name; a call it does not know is answered with the error, not raised (a bad
    call must not take the scheduler down)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.methods: dict[str, Handler] = {
            "get_stats": self.get_stats, "check_integrity": self.check_integrity,
        }
        for plugin in scheduler.plugins:
            self.methods.update(plugin.rpc_methods())
        self.deferred: list[tuple[int, Deferred]] = []

    def answer(self, call: RpcReq) -> RpcOut | None:
        """The call's answer now, or None when it was deferred (advance() sends it)."""
        handler = self.methods.get(call.method) if isinstance(call.method, str) else None
        if handler is None:
            return RpcOut(call.call_id, ValueError(f"unknown RPC method {call.method!r}"))
        result = self._run(lambda: handler(call.payload))
        if isinstance(result, Deferred):
            self.deferred.append((call.call_id, result))
            return None
        return RpcOut(call.call_id, result)

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

    def get_stats(self, _: None = None) -> dict[str, Any]:
        s = self.scheduler
        runner = s.runner
        stats = {
            "forward_seconds": runner.forward_seconds,
            "forward_calls": runner.forward_calls,
            "graph_forward_calls": runner.graph_calls,
            "compiled_forward_calls": 0 if runner.compiled is None else runner.compiled.calls,
            "decode_graphs": runner.decode_graphs(),
            "kv_available": runner.kv_pool.available_size(),
            "max_total_tokens": runner.max_total_tokens,
            "evictable_tokens": s.cache.evictable_size(),
            "protected_tokens": s.cache.protected_size(),
            "req_slots_available": runner.req_pool.available_size(),
            "max_running_requests": s.args.max_running_requests,
            "running": len(s.running),
            "waiting": len(s.waiting) + (s.chunked_req is not None),
            "num_retractions": s.memory.num_retractions,
            "evicted_tokens": s.memory.evicted_tokens,
            "new_token_ratio": s.memory.new_token_ratio,
            "prompt_tokens_total": s.prompt_tokens_total,
            "cached_tokens_total": s.cached_tokens_total,
            "jumped_tokens": s.jumped_tokens,
            "transfers_in_flight": len(self.held()),
            "images_encoded": runner.images.encoded_images if runner.images is not None else 0,
        }
        for plugin in s.plugins:
            stats.update(plugin.stats())
        return stats

    def check_integrity(self, _: None = None) -> bool:
        s = self.scheduler
        s.memory.check_integrity(s.running + ([s.chunked_req] if s.chunked_req else []) + self.held())
        return True

    def held(self) -> list:
        """Requests whose memory a plug-in holds (a disaggregation side's transfers)."""
        return [req for plugin in self.scheduler.plugins for req in plugin.holding()]
