"""Shared-prefix (cascade) attention: exact against plain attention, and used by the engine on program branches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from furcate.runtime.attention.cascade import MIN_SHARED_TOKENS, attend_with_lse, merge, shared_prefix_len
from .conftest import EXACT


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
    with Engine(str(tiny_model_dirs[arch]), **EXACT, max_total_tokens=4000, torch_num_threads=2) as engine:
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
