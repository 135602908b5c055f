"""Shared-prefix (cascade) attention: exact against plain attention, and used by the engine on program branches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import EXACT, NO_GRAMMAR
from furcate.runtime.attention.cascade import MIN_SHARED_TOKENS, attend_with_lse, merge, shared_prefix_len


def test_shared_prefix_len_stops_at_the_first_difference_and_the_shortest_cached_prefix():
    table = torch.arange(200).repeat(3, 1)
    table[1, 150] = 999
    assert shared_prefix_len(table, torch.tensor([180, 180, 180])) == 150
    assert shared_prefix_len(table, torch.tensor([180, 100, 180])) == 100
    assert shared_prefix_len(table, torch.tensor([MIN_SHARED_TOKENS - 1] * 3)) == 0
    assert shared_prefix_len(table[:1], torch.tensor([180])) == 0


def test_two_partial_attentions_merge_into_attention_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(4, 3, 10, 16)
    k, v = torch.randn(4, 3, 90, 16), torch.randn(4, 3, 90, 16)
    mask = torch.rand(4, 1, 10, 90) > 0.3
    mask[..., :70] = True  # the shared part is visible to every query
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    out_a, lse_a = attend_with_lse(q, k[..., :70, :], v[..., :70, :], 0.25)
    out_b, lse_b = attend_with_lse(q, k[..., 70:, :], v[..., 70:, :], 0.25, mask[..., 70:])
    rows_with_keys = mask[..., 70:].any(-1, keepdim=True).expand_as(out_b)
    merged = merge(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(merged[rows_with_keys], expected[rows_with_keys], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_branches_over_a_cached_prefix_match_hf_logprobs(tiny_model_dirs, hf_reference, tokenizer, arch):
    from furcate import Engine

    prefix = tokenizer.encode(" ".join(f"line {i} of a long shared context" for i in range(40)))
    assert len(prefix) > 2 * MIN_SHARED_TOKENS
    branches = [prefix + tokenizer.encode(f" branch {i} goes its own way") for i in range(6)]
    with Engine(str(tiny_model_dirs[arch]), **EXACT, **NO_GRAMMAR, max_total_tokens=4000,
                torch_num_threads=2) as engine:
        engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})
        outs = engine.generate(input_ids=branches, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True},
                               return_logprob=True, logprob_start_len=len(prefix) - 4)
    reference = hf_reference(arch)
    for ids, out in zip(branches, outs):
        assert out["meta_info"]["cached_tokens"] >= len(prefix) - 5
        assert out["output_ids"] == reference.greedy(ids, 6)
        full = reference.logprobs(ids + out["output_ids"])
        for position, (logprob, token, _) in enumerate(out["meta_info"]["input_token_logprobs"],
                                                       start=len(prefix) - 4):
            assert abs(logprob - full[position - 1, token].item()) < 1e-4
        for step, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(logprob - full[len(ids) + step - 1, token].item()) < 1e-4


def _reference_attention(q, keys, values, scale):
    """Plain causal-free attention of each request's one query over its own K/V, GQA by repeating K/V heads."""
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    weights = torch.softmax(torch.einsum("hd,khd->hk", q, keys) * scale, dim=-1)
    return torch.einsum("hk,khd->hd", weights, values).reshape(-1)


def test_a_decode_batch_with_two_shared_prefixes_gets_a_cascade_bucket_per_prefix():
    from furcate.runtime.attention.base import ForwardBatch
    from furcate.runtime.attention.torch_native import TorchNativeAttention
    from furcate.runtime.cache.memory_pool import ReqToTokenPool, TokenToKVPool

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    req_pool, kv_pool = ReqToTokenPool(8, 512), TokenToKVPool(4000, 1, kv_heads, dim, torch.float32, "cpu")
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
    prefixes = [kv_pool.alloc(150), kv_pool.alloc(90)]
    # Requests 0, 2, 4 share prefix A, 1 and 5 prefix B, 3 shares nothing; each has its own suffix.
    owners = [0, 1, 0, None, 0, 1]
    lengths = []
    for row, owner in enumerate(owners):
        own = kv_pool.alloc(5 + 7 * row)
        slots = own if owner is None else torch.cat([prefixes[owner], own])
        req_pool.req_to_token[row, : len(slots)] = slots
        lengths.append(len(slots))
    seq_lens = torch.tensor(lengths)
    new_slots = torch.stack([req_pool.req_to_token[r, n - 1] for r, n in enumerate(lengths)])
    batch = ForwardBatch(input_ids=torch.zeros(6, dtype=torch.long), positions=seq_lens - 1,
                         out_cache_loc=new_slots, req_pool_indices=torch.arange(6), prefix_lens=seq_lens - 1,
                         extend_lens=torch.ones(6, dtype=torch.long), seq_lens=seq_lens, req_to_token_pool=req_pool,
                         token_to_kv_pool=kv_pool)
    backend = TorchNativeAttention()
    backend.init_forward_metadata(batch)
    backend.begin_forward(batch)
    buckets = {tuple(b.tokens.tolist()): b.shared_len for b in backend.buckets}
    assert buckets[(0, 2, 4)] == 150 and buckets[(1, 5)] == 90
    q = torch.randn(6, heads, dim)
    k, v = torch.randn(6, kv_heads, dim), torch.randn(6, kv_heads, dim)
    out = backend.forward(q, k, v, layer_id=0, scaling=0.25, sliding_window=None)
    for r, n in enumerate(lengths):
        slots = req_pool.req_to_token[r, :n]
        keys, values = kv_pool.k_buffer[0][slots], kv_pool.v_buffer[0][slots]
        assert torch.allclose(out[r], _reference_attention(q[r], keys, values, 0.25), atol=1e-5)
