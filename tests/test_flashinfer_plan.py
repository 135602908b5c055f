"""FlashInfer's paged-KV plan, checked on CPU against torch_native: the planned pages expand to exactly the KV
slots torch_native reads, and attention over them equals torch_native's output."""

from __future__ import annotations

import random

import pytest
import torch

from furcate.runtime.attention.base import ForwardBatch
from furcate.runtime.attention.cascade import MIN_SHARED_TOKENS
from furcate.runtime.attention.flashinfer_plan import PagedKVPlan, plan_cascade, plan_paged_kv
from furcate.runtime.attention.torch_native import TorchNativeAttention, plan_all_buckets
from furcate.runtime.cache.memory_pool import ReqToTokenPool, TokenToKVPool

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
CONTEXT = 160


class PagedSlots:
    """Whole pages from a pool: page 0 stays out (it holds slot 0, the padding slot), like the pool's slot 0."""

    def __init__(self, pool_size: int, page_size: int, rng: random.Random) -> None:
        self.page_size = page_size
        self.free = list(range(1, pool_size // page_size))
        rng.shuffle(self.free)

    def take(self, n: int) -> torch.Tensor:
        pages = [self.free.pop() for _ in range(-(-n // self.page_size))]
        return torch.tensor([p * self.page_size + i for p in pages for i in range(self.page_size)][:n],
                            dtype=torch.int64)


def make_batch(rng: random.Random, page_size: int, shapes: list[tuple[int, int]],
               shared_prefix: int = 0) -> ForwardBatch:
    """shapes: (prefix_len, extend_len) per request; the first shared_prefix slots of every request are one run
    (program branches over a cached prompt), so torch_native's cascade path runs too."""
    req_pool = ReqToTokenPool(8, CONTEXT)
    kv_pool = TokenToKVPool(4096, 1, KV_HEADS, HEAD_DIM, torch.float32)
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
    slots = PagedSlots(kv_pool.size, page_size, rng) if page_size > 1 else None
    take = slots.take if slots else kv_pool.alloc
    shared = take(shared_prefix)
    rows, out_cache = [], []
    for prefix_len, extend_len in shapes:
        row = req_pool.alloc()
        seq = torch.cat([shared, take(prefix_len + extend_len - shared_prefix)])
        req_pool.req_to_token[row, : len(seq)] = seq
        rows.append(row)
        out_cache.append(seq[prefix_len:])
    prefix_lens = torch.tensor([p for p, _ in shapes])
    extend_lens = torch.tensor([e for _, e in shapes])
    positions = torch.cat([torch.arange(p, p + e) for p, e in shapes])
    return ForwardBatch(input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=positions,
                        out_cache_loc=torch.cat(out_cache), req_pool_indices=torch.tensor(rows),
                        prefix_lens=prefix_lens, extend_lens=extend_lens, seq_lens=prefix_lens + extend_lens,
                        req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)


def random_shapes(rng: random.Random, decode: bool) -> list[tuple[int, int]]:
    if decode:
        return [(rng.randint(1, 60), 1) for _ in range(rng.randint(1, 6))]
    return [(rng.randint(0, 40), rng.randint(1, 20)) for _ in range(rng.randint(1, 6))]


def expand(plan: PagedKVPlan, b: int, seq_len: int) -> torch.Tensor:
    """Request b's token slots from its planned pages: what a paged kernel reads."""
    pages = plan.kv_indices[plan.kv_indptr[b] : plan.kv_indptr[b + 1]].long()
    slots = (pages[:, None] * plan.page_size + torch.arange(plan.page_size)[None, :]).flatten()
    used = (len(pages) - 1) * plan.page_size + int(plan.kv_last_page_len[b])
    assert used == seq_len
    return slots[:used]


def reference_attention(plan: PagedKVPlan, batch: ForwardBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain softmax attention per request over the planned pages, with FlashInfer's causal alignment."""
    pool, out = batch.token_to_kv_pool, torch.empty(q.shape[0], HEADS * HEAD_DIM)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        rows = slice(int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1]))
        slots = expand(plan, b, seq_len)
        keys = pool.k_buffer[0][slots].repeat_interleave(HEADS // KV_HEADS, 1)  # [K, H, D]
        values = pool.v_buffer[0][slots].repeat_interleave(HEADS // KV_HEADS, 1)
        queries = q[rows]  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(len(queries))[:, None] + (seq_len - len(queries))
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(len(queries), -1)
    return out


CASES = [(seed, page_size, decode) for seed in range(6) for page_size in (1, 16) for decode in (False, True)]


@pytest.mark.parametrize("seed, page_size, decode", CASES)
def test_planned_pages_are_the_slots_torch_native_reads(seed, page_size, decode):
    rng = random.Random(seed)
    batch = make_batch(rng, page_size, random_shapes(rng, decode))
    plan = plan_paged_kv(batch, page_size)
    assert plan.qo_indptr.tolist() == [0, *torch.cumsum(batch.extend_lens, 0).tolist()]
    assert all(1 <= n <= page_size for n in plan.kv_last_page_len.tolist())
    assert {t.dtype for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)} == {torch.int32}
    TorchNativeAttention().init_forward_metadata(batch)
    seq_lens = batch.seq_lens.tolist()
    for bucket, members in zip(batch.attn_metadata, plan_all_buckets(batch)):
        for row, b in enumerate(members):
            assert expand(plan, b, seq_lens[b]).tolist() == bucket.kv_index[row, : seq_lens[b]].tolist()


@pytest.mark.parametrize("seed, page_size, decode", CASES)
def test_attention_over_the_plan_matches_torch_native(seed, page_size, decode):
    rng = random.Random(seed)
    shapes = random_shapes(rng, decode)
    shared = MIN_SHARED_TOKENS if seed % 2 else 0
    if shared:  # branches over one cached prompt: torch_native attends them with cascade attention
        shapes = [(p + shared, e) for p, e in shapes] + [(shared + 3, 2)]
    batch = make_batch(rng, page_size, shapes, shared_prefix=shared)
    torch.manual_seed(seed)
    tokens = int(batch.extend_lens.sum())
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))
    backend = TorchNativeAttention()
    backend.init_forward_metadata(batch)
    backend.begin_forward(batch)
    expected = backend.forward(q, k, v, layer_id=0, scaling=0.3, sliding_window=None)  # also writes k, v
    got = reference_attention(plan_paged_kv(batch, page_size), batch, q, 0.3)
    assert torch.allclose(got, expected, atol=1e-5)


def test_last_page_len_and_page_counts_at_page_boundaries():
    rng = random.Random(0)
    batch = make_batch(rng, 4, [(0, 4), (4, 1), (0, 1), (7, 2)])
    plan = plan_paged_kv(batch, 4)
    assert plan.kv_last_page_len.tolist() == [4, 1, 1, 1]
    assert plan.kv_indptr.tolist() == [0, 1, 3, 4, 7]
    with pytest.raises(ValueError, match="page_size"):
        plan_paged_kv(batch, 0)


def test_the_cascade_plan_splits_each_grouped_request_into_its_groups_prefix_and_its_own_slots():
    rng = random.Random(0)
    shapes = [(MIN_SHARED_TOKENS + 5, 3), (10, 4), (MIN_SHARED_TOKENS + 9, 1), (MIN_SHARED_TOKENS, 2)]
    batch = make_batch(rng, 1, shapes, shared_prefix=0)
    table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices]  # request b's slots are row b
    table[[2, 3], :MIN_SHARED_TOKENS] = table[0, :MIN_SHARED_TOKENS]  # requests 0, 2 and 3 share a cached prefix
    batch.req_to_token_pool.req_to_token[batch.req_pool_indices] = table
    plan = plan_cascade(batch, [[0, 2, 3]])
    assert plan.rest.tolist() == [1] and plan.rest_tokens.tolist() == [3, 4, 5, 6]
    assert plan.tokens.tolist() == [0, 1, 2, 7, 8, 9]  # request 0's rows, then 2's, then 3's
    assert plan.shared.qo_indptr.tolist() == [0, 6] and plan.shared.kv_indptr.tolist() == [0, MIN_SHARED_TOKENS]
    assert plan.shared.kv_indices.tolist() == table[0, :MIN_SHARED_TOKENS].tolist()
    assert plan.unique.qo_indptr.tolist() == [0, 3, 4, 6]
    for entry, request in enumerate([0, 2, 3]):
        own = plan.unique.kv_indices[plan.unique.kv_indptr[entry] : plan.unique.kv_indptr[entry + 1]]
        seq_len = int(batch.seq_lens[request])
        assert own.tolist() == table[request, MIN_SHARED_TOKENS:seq_len].tolist()
    assert {t.dtype for t in (plan.shared.kv_indices, plan.unique.kv_indptr, plan.unique.kv_last_page_len)} == \
        {torch.int32}
    assert plan_cascade(batch, [[0, 1]]) is None  # nothing shared: no cascade
