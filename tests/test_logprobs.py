"""Prompt and output logprobs match HF's log-softmax; top-k entries and token texts come in COMPAT's triples."""

from __future__ import annotations

import pytest
import torch

PROMPT = "when old machines sang over the quiet hills, 42 rivers of light"


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-4


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_and_output_logprobs_match_hf(engine, hf_reference, tokenizer, start):
    ids = tokenizer.encode(PROMPT)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    reference = hf_reference("llama").logprobs(full)

    prompt_entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in prompt_entries] == ids[start:]
    for position, (logprob, token, text) in zip(range(start, len(ids)), prompt_entries):
        assert text is None
        if position == 0:
            assert logprob is None
        else:
            assert _close(logprob, reference[position - 1, token].item())

    output_entries = meta["output_token_logprobs"]
    assert [t for _, t, _ in output_entries] == out["output_ids"]
    for step, (logprob, token, _) in enumerate(output_entries):
        assert _close(logprob, reference[len(ids) + step - 1, token].item())

    for step, top in enumerate(meta["output_top_logprobs"]):
        values, top_ids = reference[len(ids) + step - 1].topk(3)
        assert [t for _, t, _ in top] == top_ids.tolist()
        assert all(_close(lp, v) for (lp, _, _), v in zip(top, values.tolist()))
    assert len(meta["input_top_logprobs"]) == len(ids) - start
    assert (meta["input_top_logprobs"][0] is None) == (start == 0)


def test_default_start_reports_last_prompt_token_and_texts(engine, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0},
                          return_logprob=True, return_text_in_logprobs=True)
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == 1 and entries[0][1] == ids[-1]
    assert entries[0][2] == tokenizer.decode([ids[-1]])
    logprob, token, text = out["meta_info"]["output_token_logprobs"][0]
    assert logprob <= 0 and text == tokenizer.decode([token])


def test_batched_logprobs_equal_single(engine, tokenizer):
    """Padding and batching must not change any request's numbers."""
    prompts = [PROMPT, "a", "the river of stone and light " * 4]
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    batched = engine.generate(prompts, params, return_logprob=True, logprob_start_len=0)
    for prompt, result in zip(prompts, batched):
        single = engine.generate(prompt, params, return_logprob=True, logprob_start_len=0)
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a = torch.tensor([lp for lp, _, _ in result["meta_info"][key] if lp is not None])
            b = torch.tensor([lp for lp, _, _ in single["meta_info"][key] if lp is not None])
            assert torch.allclose(a, b, atol=1e-4)
