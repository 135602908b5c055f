"""The scheduler's control calls (RpcReq methods): statistics, cache flush, the KV integrity check, and what
plug-ins add."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import Scheduler


class SchedulerRpc:
    """Answers each RpcReq by method name; a call it does not know is answered with the error, not raised (a bad
    call must not take the scheduler down)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.methods: dict[str, Callable[[], Any]] = {
            "get_stats": self.get_stats, "flush_cache": self.flush_cache, "check_integrity": self.check_integrity,
        }
        for plugin in scheduler.plugins:
            self.methods.update(plugin.rpc_methods())

    def answer(self, method: Any) -> Any:
        handler = self.methods.get(method) if isinstance(method, str) else None
        return ValueError(f"unknown RPC method {method!r}") if handler is None else handler()

    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler
        runner = s.runner
        stats = {
            "forward_seconds": runner.forward_seconds,
            "forward_calls": runner.forward_calls,
            "graph_forward_calls": runner.graph_calls,
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
        }
        for plugin in s.plugins:
            stats.update(plugin.stats())
        return stats

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused while requests are in flight (they hold parts of it)."""
        return self.scheduler.idle and self.scheduler.cache.flush()

    def check_integrity(self) -> bool:
        s = self.scheduler
        s.memory.check_integrity(s.running + ([s.chunked_req] if s.chunked_req else []) + self.held())
        return True

    def held(self) -> list:
        """Requests whose memory a plug-in holds (a disaggregation side's transfers)."""
        return [req for plugin in self.scheduler.plugins for req in plugin.holding()]
