"""KV memory policy: allocation with eviction, the new-token reservation ratio, and retraction."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..cache.base import PrefixCache
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..config import EngineArgs
from .req import EMPTY_SLOTS, Req

logger = logging.getLogger("furcate.scheduler")

# After a retraction, reserve as if every running request will decode this many more tokens.
RETRACT_DECODE_STEPS = 20
# Output tokens reserved per request are capped, so one huge max_new_tokens cannot block admission forever.
CLIP_MAX_NEW_TOKENS = 4096


def reserved_output(req: Req, ratio: float) -> int:
    return int(min(req.remaining_output, CLIP_MAX_NEW_TOKENS) * ratio)


class MemoryManager:
    def __init__(self, args: EngineArgs, cache: PrefixCache, req_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool) -> None:
        self.cache = cache
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.new_token_ratio = args.init_new_token_ratio
        self.min_new_token_ratio = args.min_new_token_ratio
        self.ratio_decay = (args.init_new_token_ratio - args.min_new_token_ratio) / args.new_token_ratio_decay_steps
        self.num_retractions = 0
        self.evicted_tokens = 0

    def room(self) -> int:
        return self.kv_pool.available_size() + self.cache.evictable_size()

    def alloc(self, n: int) -> torch.Tensor:
        """n KV slots, evicting cached prefixes as needed; admission and retraction guarantee they exist."""
        shortfall = n - self.kv_pool.available_size()
        if shortfall > 0:
            self.evicted_tokens += self.cache.evict(shortfall)
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise RuntimeError(f"KV pool exhausted: needed {n} slots, {self.kv_pool.available_size()} free")
        return slots

    def release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and forget where it lived."""
        if req.req_pool_idx is None:
            return
        known = len(req.fill_ids)
        if req.kv_len > known:  # K/V of a token the scheduler has not seen yet (overlap loop): not cacheable
            self.kv_pool.free(self.req_pool.req_to_token[req.req_pool_idx, known : req.kv_len].clone())
            req.kv_len = known
        self.cache.cache_finished_req(req)
        req.req_pool_idx = None
        req.kv_len = 0
        req.prefix_indices, req.last_node = EMPTY_SLOTS, None

    def make_decode_room(self, running: list[Req], retract: Callable[[Req], None]) -> None:
        """Before a decode step: one slot per running request, retracting the cheapest to redo if short."""
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_new_token_ratio)
        if self.room() >= len(running):
            return
        # Cheapest to redo: fewest decoded tokens, then shortest prompt. The last one standing always fits,
        # because no request is admitted whose whole prompt and output exceed the pool.
        victims = sorted(running, key=lambda r: (len(r.output_ids), len(r.input_ids)))
        retracted = 0
        while self.room() < len(running) and len(running) > 1:
            retract(victims.pop(0))
            retracted += 1
        self.num_retractions += retracted
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(r.params.max_new_tokens for r in running) or 1
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / budget)
        logger.warning("KV memory ran out: retracted %d request(s) (total %d); new_token_ratio is now %.2f",
                       retracted, self.num_retractions, self.new_token_ratio)

    def check_integrity(self, active: list[Req]) -> None:
        """Every KV slot is exactly one of: free, owned by the prefix cache, or owned by one active request."""
        self.cache.check_integrity()
        free = set(self.kv_pool._free)
        cached = set(self.cache.owned_slots().tolist())
        assert not free & cached, "a slot is both free and cached"
        owned: set[int] = set()
        for req in active:
            row = set(self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist())
            own = row - cached
            assert not own & free, f"request {req.rid} reads a free slot"
            assert not own & owned, f"request {req.rid} shares a slot it does not own"
            owned |= own
        assert len(free) + len(cached) + len(owned) == self.kv_pool.size, "a KV slot is unaccounted for"
