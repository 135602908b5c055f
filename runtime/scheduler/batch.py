"""A batch the scheduler hands to the model runner: which requests, and which of their tokens to compute.

Building a batch allocates the KV slots of its new tokens and records them in the request-to-token table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.base import ForwardBatch
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from .req import Req


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward: ForwardBatch
    is_prefill: bool
    # For each request, the range of its packed tokens whose logits are needed (input logprobs + next token).
    logit_ranges: list[range]


def build_prefill(reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> ScheduleBatch:
    """Whole prompts of newly admitted requests; the caller has checked that the pools have room."""
    extend_lens = [len(r.input_ids) for r in reqs]
    slots = kv_pool.alloc(sum(extend_lens))
    assert slots is not None, "admission must guarantee KV room for a prefill"
    offset = 0
    logit_ranges = []
    for req, n in zip(reqs, extend_lens):
        req.req_pool_idx = req_pool.alloc()
        assert req.req_pool_idx is not None, "admission must guarantee a request slot"
        req_pool.req_to_token[req.req_pool_idx, :n] = slots[offset : offset + n]
        req.kv_len = n
        first = max(req.input_logprob_start, 1) - 1 if req.return_logprob else n - 1
        logit_ranges.append(range(offset + first, offset + n))
        offset += n
    forward = ForwardBatch(
        input_ids=torch.tensor([t for r in reqs for t in r.input_ids], dtype=torch.long),
        positions=torch.cat([torch.arange(n) for n in extend_lens]),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.long),
        prefix_lens=torch.zeros(len(reqs), dtype=torch.long),
        extend_lens=torch.tensor(extend_lens, dtype=torch.long),
        seq_lens=torch.tensor(extend_lens, dtype=torch.long),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    return ScheduleBatch(reqs, forward, True, logit_ranges)


def build_decode(reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> ScheduleBatch:
    """One new token per running request: the last sampled token, whose K/V is computed now."""
    slots = kv_pool.alloc(len(reqs))
    assert slots is not None, "admission reserves every running request's output tokens"
    positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.long)
    pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.long)
    req_pool.req_to_token[pool_indices, positions] = slots
    for req in reqs:
        req.kv_len += 1
    forward = ForwardBatch(
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long),
        positions=positions,
        out_cache_loc=slots,
        req_pool_indices=pool_indices,
        prefix_lens=positions,
        extend_lens=torch.ones(len(reqs), dtype=torch.long),
        seq_lens=positions + 1,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    return ScheduleBatch(reqs, forward, False, [range(i, i + 1) for i in range(len(reqs))])


def release(req: Req, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
    """Free a finished or aborted request's KV slots and table row."""
    if req.req_pool_idx is None:
        return
    kv_pool.free(req_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone())
    req_pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_len = 0
