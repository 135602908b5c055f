"""The sampler's logit arithmetic, checked on hand-made logits without a model."""

from __future__ import annotations

import torch

from furcate.runtime.sampling.params import SamplingParams
from furcate.runtime.sampling.sampler import SamplingRow, adjust_logits, sample


def row(output_ids=(), prompt_ids=(), seed=0, stop_ids=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt_ids), list(output_ids), seed, frozenset(stop_ids))


def test_frequency_and_presence_penalties_see_output_only():
    logits = torch.zeros(1, 6)
    adjusted = adjust_logits(logits, [row(output_ids=[1, 1, 3], prompt_ids=[4],
                                          frequency_penalty=0.5, presence_penalty=0.25)])
    assert adjusted[0].tolist() == [0.0, -1.25, 0.0, -0.75, 0.0, 0.0]
    assert logits.abs().sum() == 0, "raw logits stay untouched for logprobs"


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    adjusted = adjust_logits(logits, [row(output_ids=[0], prompt_ids=[1], repetition_penalty=2.0)])
    assert adjusted[0].tolist() == [1.0, -4.0, 2.0, 1.0]


def test_logit_bias_and_min_tokens_mask():
    logits = torch.zeros(1, 5)
    adjusted = adjust_logits(logits, [row(logit_bias={3: 2.5}, min_new_tokens=2, stop_ids={4})])
    assert adjusted[0, 3] == 2.5 and adjusted[0, 4] == float("-inf")
    done = adjust_logits(logits, [row(output_ids=[0, 0], min_new_tokens=2, stop_ids={4})])
    assert done[0, 4] == 0.0


def test_top_k_and_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k = {int(sample(logits, [row(seed=s, top_k=2)])[0]) for s in range(200)}
    assert seen_k == {0, 1}
    seen_min_p = {int(sample(logits, [row(seed=s, min_p=0.5)])[0]) for s in range(200)}
    assert seen_min_p == {0, 1}
    seen_top_p = {int(sample(logits, [row(seed=s, top_p=0.7)])[0]) for s in range(200)}
    assert seen_top_p == {0, 1}


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = torch.tensor([int(sample(logits, [row(seed=s)])[0]) for s in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_greedy_rows_take_argmax_beside_random_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    picked = sample(logits, [row(temperature=0.0), row(seed=5, temperature=1.0)])
    assert picked[0] == 1
