"""The scheduler's control calls (RpcReq methods): statistics, cache flush, the KV integrity check."""

from __future__ import annotations

from typing import Any


class SchedulerRpc:
    """Mixed into Scheduler: every `rpc_<method>` answers RpcReq(method)."""

    def rpc_get_stats(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "forward_seconds": runner.forward_seconds,
            "forward_calls": runner.forward_calls,
            "kv_available": runner.kv_pool.available_size(),
            "max_total_tokens": runner.max_total_tokens,
            "evictable_tokens": self.cache.evictable_size(),
            "protected_tokens": self.cache.protected_size(),
            "req_slots_available": runner.req_pool.available_size(),
            "max_running_requests": self.args.max_running_requests,
            "running": len(self.running),
            "waiting": len(self.waiting) + (self.chunked_req is not None),
            "num_retractions": self.memory.num_retractions,
            "evicted_tokens": self.memory.evicted_tokens,
            "new_token_ratio": self.memory.new_token_ratio,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "jumped_tokens": self.jumped_tokens,
            **self.grammars.stats(),
            "transfers_in_flight": len(side.holding()) if (side := self.prefill_sender or self.decode_receiver) else 0,
            **(self.prefill_sender.stats if self.prefill_sender else {}),
        }

    def rpc_flush_cache(self) -> bool:
        """Drop the prefix cache; refused while requests are in flight (they hold parts of it)."""
        return self.idle and self.cache.flush()

    def rpc_check_integrity(self) -> bool:
        side = self.prefill_sender or self.decode_receiver
        held = side.holding() if side else []
        self.memory.check_integrity(self.running + ([self.chunked_req] if self.chunked_req else []) + held)
        return True
