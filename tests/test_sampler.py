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


def _expected(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The filtered distribution, from the definitions (a reference independent of the batched code)."""
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank and ((top_k and rank >= top_k) or mass >= top_p or probs[i] < min_p * probs[order[0]]):
            break
        kept.append(i)
        mass += float(probs[i])
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


FILTERS = [{}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.3}, {"top_k": 2, "top_p": 0.9}, {"top_p": 0.999}]


def test_batched_draws_follow_each_rows_filtered_distribution():
    """Six rows with different filters share every batch; over 3000 seeds each row's frequencies match its own
    distribution. The 1000-token vocabulary is not a multiple of the block size, and top_p=0.999 keeps more
    tokens than the sampler's first head (so that row takes the full-sort path)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(FILTERS), 1000, generator=generator) * 0.5
    logits[:, :5] += torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0])
    draws = torch.stack([sample(logits, [row(seed=s * 7 + r, **f) for r, f in enumerate(FILTERS)])
                         for s in range(3000)])
    for r, filters in enumerate(FILTERS):
        expected = _expected(torch.softmax(logits[r], -1), **filters)
        freq = torch.bincount(draws[:, r], minlength=1000).float() / len(draws)
        # The five boosted tokens one by one, the long tail as one bin (995 bins of 3 draws would be noise).
        def binned(p: torch.Tensor) -> torch.Tensor:
            return torch.cat([p[:5], p[5:].sum(0, keepdim=True)])

        assert (binned(freq) - binned(expected)).abs().max() < 0.03, (filters, binned(freq), binned(expected))
        assert expected[draws[:, r]].min() > 0, "a filtered-out token was drawn"


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(1))
    for seed in range(40):
        for filters in FILTERS:
            alone = int(sample(logits, [row(seed=seed, **filters)])[0])
            neighbours = [row(seed=99, top_k=400), row(seed=98), row(temperature=0.0)]
            batch = torch.cat([logits.repeat(3, 1), logits])
            assert int(sample(batch, [*neighbours, row(seed=seed, **filters)])[3]) == alone


def test_masked_tokens_are_never_drawn():
    logits = torch.full((2, 3000), float("-inf"))
    allowed = torch.tensor([7, 700, 2999])
    logits[:, allowed] = torch.tensor([0.0, -1.0, -2.0])
    for seed in range(300):
        picked = sample(logits, [row(seed=seed), row(seed=seed, top_p=0.95, top_k=50)])
        assert set(picked.tolist()) <= set(allowed.tolist())


def test_top_k_one_and_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(2))
    picked = sample(logits, [row(temperature=0.0), row(seed=3, top_k=1), row(seed=4, top_k=1, top_p=0.5),
                             row(temperature=0.0)])
    assert picked.tolist() == logits.argmax(-1).tolist()


def test_grammar_rows_masked_as_xgrammars_kernel_masks_them():
    """On a GPU mask_rows hands the rows to xgrammar's kernel (vocab_size, indices); its CPU twin, called the same
    way, must mask exactly what the torch path masks here, and leave the other rows alone."""
    import xgrammar

    from furcate.grammars.base import allocate_bitmask
    from furcate.runtime.sampling.sampler import mask_rows

    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = allocate_bitmask(4, vocab)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=generator, dtype=torch.int32))
    rows = [0, 2]
    ours, theirs = logits.clone(), logits.clone()
    mask_rows(ours, bitmask, rows)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])
    assert bool(torch.isinf(ours[rows]).any())
