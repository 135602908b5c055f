"""N-gram speculative decoding: greedy output is token for token the output without it (and HF's), stops cut where
plain decoding stops, logprobs are the plain ones, sampled tokens keep their distribution, and no KV of a rejected
draft survives a step.

Random models rarely repeat their prompt, so the prompts that must be drafted right are built on the tiny mistral
model: with its 24-token sliding window (two layers), its next token depends on the last 48 tokens only, so after
prompt X + G + X, where G is its own greedy continuation of X, it writes G again, and prompt lookup drafts G.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re

import pytest
import torch

from conftest import EXACT, NO_GRAMMAR, TINY_POOL_TOKENS, assert_pool_free, shut_down, start_side_by_side
from furcate.runtime.config import EngineArgs
from furcate.runtime.sampling.params import SamplingParams
from furcate.runtime.sampling.sampler import SamplingRow, sample, sampling_probs
from furcate.runtime.speculative.ngram import NgramIndex
from furcate.runtime.speculative.verify import Proposal, verify
from test_greedy_matches_hf import make_prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SPEC = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
COMMON = {**EXACT, "max_total_tokens": TINY_POOL_TOKENS, "torch_num_threads": 2}


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    """Speculative and plain engines on the tiny mistral model (grammars on, for the constrained test), and
    speculative ones on llama (radix cache off, a pool small enough to retract) and qwen2 (16-token chunks,
    compiled decode)."""
    mistral, llama, qwen = (str(tiny_model_dirs[arch]) for arch in ("mistral", "llama", "qwen2"))
    grammar = {"grammar_backend": "xgrammar"}  # one backend's tables: the engine starts faster than with auto's
    started = start_side_by_side(
        (mistral, {**COMMON, **grammar, **SPEC}),
        (mistral, {**COMMON, **grammar}),
        (llama, {**COMMON, **NO_GRAMMAR, **SPEC, "disable_radix_cache": True, "max_total_tokens": 256,
                 "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05}),
        # Compiled decode (the CPU default) runs the steps where no request has drafts; verifies stay eager.
        (qwen, {**COMMON, **NO_GRAMMAR, **SPEC, "chunked_prefill_size": 16, "enable_torch_compile": True,
                "torch_compile_max_bs": 8}),
    )
    yield dict(zip(("spec", "plain", "llama", "qwen2"), started))
    shut_down(started)


@pytest.fixture(scope="module")
def copy_prompts(engines):
    """Prompts after which the mistral model writes text its prompt holds: X + G + X (all of G is drafted right),
    and X + G[:8] + Y + X (drafts go wrong after 8 tokens, then the model goes on with G)."""
    rng = random.Random(7)
    prompts = []
    for length in (50, 64, 80):
        x = [rng.randrange(3, 49000) for _ in range(length)]
        g = engines["plain"].generate(input_ids=x, sampling_params={**GREEDY, "max_new_tokens": 32})["output_ids"]
        prompts.append(x + g + x)
    y = [rng.randrange(3, 49000) for _ in range(12)]
    prompts.append(prompts[0][:58] + y + prompts[0][:50])
    return prompts


def spec_counts(results: list[dict]) -> tuple[int, int]:
    return (sum(r["meta_info"]["spec_draft_token_num"] for r in results),
            sum(r["meta_info"]["spec_accept_token_num"] for r in results))


# -- greedy equality -----------------------------------------------------------------------------------------


def test_greedy_copies_equal_plain_and_hf(engines, copy_prompts, hf_reference):
    params = [{**GREEDY, "max_new_tokens": n} for n in (30, 24, 40, 36)]
    plain = engines["plain"].generate(input_ids=copy_prompts, sampling_params=params)
    spec = engines["spec"].generate(input_ids=copy_prompts, sampling_params=params)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    hf = hf_reference("mistral")
    assert spec[2]["output_ids"] == hf.greedy(copy_prompts[2], 40)
    drafted, accepted = spec_counts(spec)
    assert accepted > 20 and drafted > accepted, (drafted, accepted)  # long runs accepted, and some rejected
    assert spec[0]["meta_info"]["spec_accept_length"] > 2
    assert "spec_verify_ct" not in plain[0]["meta_info"]
    assert_pool_free(engines["spec"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_batch_equals_hf(arch, engines, hf_reference, tokenizer):
    """Batch of 8 prompts of different lengths with repeats (llama: radix cache off, a 256-token pool that
    under-reserves outputs, so it retracts requests; qwen2: prompts prefilled in 16-token chunks). A logit bias
    keeps every output among a dozen of the prompts' tokens, so outputs repeat and get drafted (mostly wrong:
    these random models copy nothing), while which of them wins still depends on the whole context."""
    words = [p.split()[:12] for p in make_prompts(8, seed=11)]
    prompts = [" ".join(w * (1 + i % 3)) for i, w in enumerate(words)]
    favoured = sorted({t for p in prompts for t in tokenizer.encode(p)})[:12]
    lengths = [6 + 3 * i for i in range(len(prompts))]
    engine = engines[arch]
    bias = {"logit_bias": {t: 100.0 for t in favoured}}
    out = engine.generate(prompts, [{**GREEDY, **bias, "max_new_tokens": n} for n in lengths])
    hf = hf_reference(arch)
    expected = [hf.greedy(tokenizer.encode(p), n, sequence_bias={(t,): 100.0 for t in favoured})
                for p, n in zip(prompts, lengths)]
    assert [r["output_ids"] for r in out] == expected
    drafted, accepted = spec_counts(out)
    assert drafted > accepted, "no rejected drafts: the verify path was not exercised"
    if arch == "llama":
        assert engine.get_stats()["num_retractions"] > 0, "the small pool was meant to force retraction"
    else:
        assert engine.get_stats()["compiled_forward_calls"] > 0, "no step ran through the decode graphs"
    assert_pool_free(engine)


# -- stops, logprobs, grammars, sampling, abort --------------------------------------------------------------


def test_stops_cut_where_plain_decoding_stops(engines, copy_prompts, tokenizer):
    prompt = copy_prompts[0]
    full = engines["plain"].generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
    ids, text = full["output_ids"], full["text"]
    stop_text = text[len(text) // 2 : len(text) // 2 + 4]
    cases = [{"max_new_tokens": 7}, {"max_new_tokens": 30, "stop_token_ids": [ids[9]]},
             {"max_new_tokens": 30, "stop_token_ids": [ids[2]], "min_new_tokens": 5},
             {"max_new_tokens": 30, "stop": [stop_text]}, {"max_new_tokens": 30, "stop": [stop_text],
                                                           "no_stop_trim": True}]
    params = [{**GREEDY, **case} for case in cases]
    plain = engines["plain"].generate(input_ids=[prompt] * len(params), sampling_params=params)
    spec = engines["spec"].generate(input_ids=[prompt] * len(params), sampling_params=params)
    for p, s in zip(plain, spec):
        assert (s["output_ids"], s["text"]) == (p["output_ids"], p["text"])
        assert s["meta_info"]["finish_reason"] == p["meta_info"]["finish_reason"]
    assert len(spec[0]["output_ids"]) == 7
    assert spec[1]["output_ids"] == ids[: ids.index(ids[9]) + 1]
    assert spec_counts(spec)[1] > 0
    assert_pool_free(engines["spec"])


def test_logprobs_are_the_plain_ones(engines, copy_prompts):
    """Also over the prefix cache: each prompt again with its output appended reads the K/V the speculative
    request left there (a rejected draft's would change these logprobs)."""
    kwargs = {"sampling_params": {**GREEDY, "max_new_tokens": 20}, "return_logprob": True, "top_logprobs_num": 3}
    plain = engines["plain"].generate(input_ids=copy_prompts[:2], **kwargs)
    spec = engines["spec"].generate(input_ids=copy_prompts[:2], **kwargs)
    assert spec_counts(spec)[1] > 0
    again = [p + r["output_ids"] for p, r in zip(copy_prompts, spec)]
    plain += engines["plain"].generate(input_ids=again, **kwargs)
    spec += engines["spec"].generate(input_ids=again, **kwargs)
    assert all(r["meta_info"]["cached_tokens"] >= len(p) - 2 for p, r in zip(again, spec[2:]))
    for p, s in zip(plain, spec):
        assert s["output_ids"] == p["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            got, want = s["meta_info"][key], p["meta_info"][key]
            assert [e[1] for e in got] == [e[1] for e in want]
            assert torch.allclose(torch.tensor([e[0] or 0.0 for e in got]), torch.tensor([e[0] or 0.0 for e in want]),
                                  atol=1e-4)
        tops = [[t[1] for t in entry] for entry in s["meta_info"]["output_top_logprobs"]]
        assert tops == [[t[1] for t in entry] for entry in p["meta_info"]["output_top_logprobs"]]
    assert_pool_free(engines["spec"])


def test_constrained_output_equals_plain(engines):
    """Drafts are checked by the grammar (advanced, masked per row, rolled back) and end where it forces text."""
    regex = r"(red|green|blue)( (red|green|blue)){11}"
    params = {**GREEDY, "max_new_tokens": 60, "regex": regex}
    prompts = ["colors: red green red green red green blue", "pick: blue blue red"]
    plain = engines["plain"].generate(prompts, params)
    spec = engines["spec"].generate(prompts, params)
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    assert all(re.fullmatch(regex, r["text"]) for r in spec)
    assert_pool_free(engines["spec"])


def test_sampled_requests_finish_and_repeat_with_a_seed(engines, copy_prompts):
    params = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 24, "sampling_seed": 5, "ignore_eos": True}
    first = engines["spec"].generate(input_ids=copy_prompts[:3], sampling_params=params)
    again = engines["spec"].generate(input_ids=copy_prompts[:3], sampling_params=params)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert all(len(r["output_ids"]) == 24 for r in first)
    assert_pool_free(engines["spec"])


def test_abort_mid_generation_frees_everything(engines, copy_prompts):
    engine = engines["spec"]

    async def run() -> list[dict]:
        stream = await engine.async_generate(input_ids=copy_prompts[1], sampling_params={
            **GREEDY, "max_new_tokens": 400}, stream=True, rid="spec-abort")
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                engine.abort("spec-abort")
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_pool_free(engine)


# -- the acceptance rule, without a model --------------------------------------------------------------------


def row(seed: int = 0, output_ids: tuple = (), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1], list(output_ids), seed, frozenset())


def test_greedy_rule_accepts_argmax_drafts_then_corrects():
    logits = torch.full((4, 6), -1.0)
    for position, best in enumerate([3, 1, 4, 2]):
        logits[position, best] = 5.0
    base = row(temperature=0.0)
    assert verify(logits, [Proposal.of(base, [3, 1, 4])]) == [[3, 1, 4, 2]]  # all accepted, then the bonus
    assert verify(logits[:3], [Proposal.of(base, [3, 5])]) == [[3, 1]]  # second wrong: corrected
    assert verify(logits[:1], [Proposal.of(base, [])]) == [[3]]


def test_sampled_rule_keeps_the_distribution():
    """Many seeded trials of one 2-draft step: the first token follows p0 (plain decoding's distribution, checked
    against the plain sampler too), and after an accepted first draft the second follows p1. A rule that, say,
    resampled from p without removing the rejected draft would move p0(d0) = 0.3 to ~0.5."""
    torch.manual_seed(0)
    vocab, trials = 10, 20000
    logits = torch.randn(3, vocab) * 1.5
    params = {"temperature": 0.8, "top_k": 7, "top_p": 0.97}
    p0, p1 = sampling_probs(logits[:2], [row(**params)] * 2)
    d0 = int(torch.argsort(p0, descending=True)[1])  # likely but not the likeliest
    d1 = int(torch.argsort(p1)[0])  # filtered out: always rejected, the residual is p1 itself
    proposals = [Proposal.of(row(seed, **params), [d0, d1]) for seed in range(trials)]
    emitted = verify(logits.repeat(trials, 1), proposals)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab) / trials
    after = [e[1] for e in emitted if e[0] == d0]
    second = torch.bincount(torch.tensor(after), minlength=vocab) / len(after)
    plain = sample(logits[:1].repeat(trials, 1), [row(seed, **params) for seed in range(trials)])
    plain_first = torch.bincount(plain, minlength=vocab) / trials
    assert 0.5 * (first - p0).abs().sum() < 0.03
    assert 0.5 * (plain_first - p0).abs().sum() < 0.03
    assert 0.5 * (second - p1).abs().sum() < 0.04
    assert first[p0 == 0].sum() == 0 and second[p1 == 0].sum() == 0


# -- drafting and configuration ------------------------------------------------------------------------------


def test_ngram_index_drafts_after_the_latest_longest_match():
    index = NgramIndex(1, 3)
    index.sync([7, 1, 2, 3, 9, 4, 2, 3, 5, 6, 1, 2, 3], [])
    assert index.propose(3) == [9, 4, 2]  # (1, 2, 3) matched, not the later (2, 3)
    index.sync([7, 1, 2, 3, 9, 4, 2, 3, 5, 6, 1, 2, 3], [5])
    assert index.propose(5) == [6, 1, 2, 3, 5]  # (3, 5): what followed, up to the end
    index.sync([7, 1, 2, 3, 9, 4, 2, 3, 5, 6, 1, 2, 3], [5, 8])
    assert index.propose(3) == []


@pytest.mark.parametrize("args, message", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm must be one of ('NGRAM', 'STANDALONE')"),
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be an integer in [1, 64]"),
    ({"speculative_num_draft_tokens": 65}, "speculative_num_draft_tokens"),
    ({"speculative_ngram_min_match_window_size": 0}, "speculative_ngram_min_match_window_size"),
    ({"speculative_ngram_max_match_window_size": 2.5}, "speculative_ngram_max_match_window_size"),
    ({"speculative_ngram_min_match_window_size": 5, "speculative_ngram_max_match_window_size": 3}, "<="),
    ({"speculative_algorithm": "NGRAM", "disable_overlap_schedule": False}, "plain loop only"),
])
def test_bad_config_is_refused(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineArgs(**args)


def test_cli_flags_reach_the_engine_args():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-algorithm", "NGRAM",
                                                       "--speculative-num-draft-tokens", "6"]))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 6)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-algorithm", "EAGLE"])
