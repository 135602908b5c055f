"""Admission: which waiting requests join the next prefill batch, under memory, token and chunk budgets."""

from __future__ import annotations

from ..cache.base import PrefixCache
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..executor.batch import ReqSlice
from .memory import reserved_output
from .req import Req

# A waiting request sharing this many not-yet-cached tokens with one admitted this round waits a round,
# so it hits the cache the admitted one fills instead of computing the same prefix twice.
IN_BATCH_PREFIX_THRESHOLD = 32


class PrefillAdder:
    def __init__(self, cache: PrefixCache, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, running: list[Req],
                 new_token_ratio: float, max_prefill_tokens: int, chunk_size: int, max_running: int) -> None:
        self.cache = cache
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.ratio = new_token_ratio
        # Slots promised to running requests' future outputs and to requests admitted this round.
        self.reserved = sum(reserved_output(r, new_token_ratio) for r in running)
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunk_size if chunk_size > 0 else None
        self.rem_reqs = min(max_running - len(running), req_pool.available_size())
        self.slices: list[ReqSlice] = []
        self.deferred: list[Req] = []

    def rem_total(self) -> int:
        """Slots that can still be promised: free plus evictable, less every reservation."""
        return self.kv_pool.available_size() + self.cache.evictable_size() - self.reserved

    def add_chunked(self, req: Req, keep_free: int = 0) -> bool:
        """The request whose prompt is mid-way through chunked prefill continues first, every step, with as much
        of its next chunk as the pool holds now, less keep_free (the decode tokens of a mixed batch): running
        requests may have outgrown what was reserved for them since it was admitted. False when not one slot is
        left: it waits while decoding frees (or retracts) some."""
        room = self.kv_pool.available_size() + self.cache.evictable_size() - keep_free
        if room <= 0:
            return False
        self._take(ReqSlice.next_of(req, room if self.rem_chunk is None else min(self.rem_chunk, room)))
        self.reserved += reserved_output(req, self.ratio)
        return True

    def add(self, req: Req, check_sharing: bool) -> bool:
        """Try to admit one waiting request; returns False when no later request can fit this round either."""
        if self.rem_reqs <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return False
        if check_sharing and self._shares_uncached_prefix(req):
            self.deferred.append(req)
            return True
        extend = len(req.input_ids) + len(req.output_ids) - len(req.prefix_indices)
        first_slice = extend if self.rem_chunk is None else min(extend, self.rem_chunk)
        if self.slices and first_slice > self.rem_input:
            return False
        if extend + reserved_output(req, self.ratio) > self.rem_total():
            return False
        self._start(req)
        self._take(ReqSlice.next_of(req, self.rem_chunk))
        self.reserved += reserved_output(req, self.ratio)
        self.rem_reqs -= 1
        return True

    def _start(self, req: Req) -> None:
        """Lock the matched prefix, give the request a table row and point it at the cached slots."""
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.req_pool.alloc()
        prefix = len(req.prefix_indices)
        self.req_pool.req_to_token[req.req_pool_idx, :prefix] = req.prefix_indices
        req.kv_len = prefix
        if req.cached_tokens < 0:
            req.cached_tokens = prefix

    def _take(self, piece: ReqSlice) -> None:
        self.slices.append(piece)
        self.reserved += piece.length
        self.rem_input -= piece.length
        if self.rem_chunk is not None:
            self.rem_chunk -= piece.length

    def _shares_uncached_prefix(self, req: Req) -> bool:
        fill = req.fill_ids
        cached = len(req.prefix_indices)
        for piece in self.slices:
            other = piece.req.fill_ids
            shared = 0
            limit = min(len(fill), len(other))
            while shared < limit and fill[shared] == other[shared]:
                shared += 1
            if shared - cached >= IN_BATCH_PREFIX_THRESHOLD:
                return True
        return False

    @property
    def chunked_req(self) -> Req | None:
        """The admitted request whose last slice stops short of its prompt's end, if any."""
        return next((p.req for p in self.slices if not p.samples), None)
