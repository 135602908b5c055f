"""The prefix cache used when radix caching is off: nothing is shared, everything is freed at request end.

It still serves chunked prefill: an unfinished request's computed tokens are its own "prefix" for the next chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import MatchResult
from .memory_pool import ReqToTokenPool, TokenToKVPool

EMPTY = torch.empty(0, dtype=torch.int64, device="cpu")  # KV slot lists are host bookkeeping


class ChunkCache:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(EMPTY, None)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_unfinished_req(self, req: Any) -> None:
        req.prefix_indices = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()

    def cache_finished_req(self, req: Any) -> None:
        self.kv_pool.free(self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone())
        self.req_pool.free(req.req_pool_idx)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def owned_slots(self) -> torch.Tensor:
        return EMPTY

    def flush(self) -> bool:
        return True

    def retire(self) -> int:
        """New weights: nothing is cached across requests, so nothing goes stale here."""
        return 0

    def check_integrity(self) -> None:
        pass
