"""The paged decode attention kernel (paged_decode.c) against SDPA over gathered K/V, and how engines use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from furcate.runtime.attention import paged_decode
from furcate.runtime.attention.base import ModelAttention

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason=f"kernel: {paged_decode.library()}")

POOL = 3000


def reference(q, k_pool, v_pool, kv_index, seq_lens, scale):
    """SDPA in float32 over each request's gathered slots, its query heads grouped under their KV head."""
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    rows = []
    for b in range(batch):
        slots = kv_index[b, : seq_lens[b]]
        keys, values = (pool[slots].transpose(0, 1).float() for pool in (k_pool, v_pool))
        grouped = q[b].view(kv_heads, heads // kv_heads, dim).float()
        rows.append(F.scaled_dot_product_attention(grouped, keys, values, scale=scale).reshape(heads, dim))
    return torch.stack(rows)


def case(batch, heads, kv_heads, dim, length, dtype, query_scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k_pool, v_pool = (torch.randn(POOL, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    q = (torch.randn(batch, heads, dim, generator=generator) * query_scale).to(dtype)
    kv_index = torch.randint(1, POOL, (batch, length), generator=generator)
    seq_lens = torch.randint(1, length + 1, (batch,), generator=generator)
    seq_lens[0] = length
    return q, k_pool, v_pool, kv_index, seq_lens


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch, heads, kv_heads, dim, length", [
    (1, 9, 3, 64, 1),  # one key
    (1, 9, 3, 64, 64), (2, 9, 3, 64, 65),  # a block exactly, and one key past it
    (32, 9, 3, 64, 300),  # the default model's shape at a serving batch
    (3, 32, 8, 128, 200), (2, 16, 1, 256, 130), (4, 4, 4, 16, 70),  # other groups and head sizes
    (8, 128, 16, 16, 40),  # more query heads than a work item holds: two items a request
])
def test_matches_sdpa_over_gathered_keys(batch, heads, kv_heads, dim, length, dtype, tolerance):
    q, k_pool, v_pool, kv_index, seq_lens = case(batch, heads, kv_heads, dim, length, dtype)
    out = paged_decode.attention(q, k_pool, v_pool, kv_index, seq_lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k_pool, v_pool, kv_index, seq_lens, dim**-0.5),
                               rtol=tolerance, atol=tolerance)


def test_large_scores_stay_finite():
    """Scores in the thousands: the running maximum keeps every exponential in range."""
    q, k_pool, v_pool, kv_index, seq_lens = case(4, 8, 2, 64, 500, torch.float32, query_scale=400.0)
    out = paged_decode.attention(q, k_pool, v_pool, kv_index, seq_lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, kv_index, seq_lens, 0.125), rtol=1e-4, atol=1e-4)


def test_slots_outside_the_pool_read_slot_zero():
    """A corrupt slot table never reads past the pool: such slots read the reserved slot 0."""
    q, k_pool, v_pool, kv_index, seq_lens = case(2, 4, 2, 16, 10, torch.float32)
    bad = kv_index.clone()
    bad[0, 3], bad[1, 0] = POOL + 10**9, -5
    fixed = bad.clone()
    fixed[0, 3], fixed[1, 0] = 0, 0
    torch.testing.assert_close(paged_decode.attention(q, k_pool, v_pool, bad, seq_lens, 0.25),
                               paged_decode.attention(q, k_pool, v_pool, fixed, seq_lens, 0.25))


def test_shapes_beyond_its_limits_are_refused():
    q, k_pool, v_pool, kv_index, seq_lens = case(1, 4, 2, 24, 5, torch.float32)  # 24: not a multiple of 16
    assert not paged_decode.supports(4, 2, 24, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_decode.attention(q, k_pool, v_pool, kv_index, seq_lens, 0.2)
    assert not paged_decode.supports(34, 2, 64, torch.float32)  # 17 query heads per KV head
    assert not paged_decode.supports(4, 2, 64, torch.float16)


@pytest.mark.parametrize("change, serves", [
    ({}, True), ({"windows": frozenset({None, 4096})}, False), ({"logit_cap": 50.0}, False),
    ({"num_kv_heads": None}, False), ({"head_dim": 24}, False),
])
def test_models_it_serves(change, serves):
    shape = dict(num_heads=8, head_dim=64, scaling=0.125, dtype=torch.float32, num_kv_heads=2)
    assert paged_decode.serves(ModelAttention(**{**shape, **change})) is serves
    assert not paged_decode.serves(None)
