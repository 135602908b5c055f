"""Radix cache, chunked prefill, policies and retraction keep greedy outputs equal to HF's."""

from __future__ import annotations

import random

import pytest

from conftest import EXACT, NO_GRAMMAR, assert_pool_free, engines_side_by_side, shut_down, start_side_by_side
from furcate import Engine

SHARED = ("You are a careful assistant. Answer in one word. The river of stone runs under quiet hills, and old "
          "machines sang when the light was 42 and 3.14. ")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def branch_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone light 7 9 hills".split()
    return [SHARED + " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def expected(hf_reference, tokenizer):
    hf = hf_reference("llama")
    prompts = branch_prompts(8, seed=5)
    lengths = [6 + 2 * i for i in range(len(prompts))]
    return prompts, lengths, [hf.greedy(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]


CONFIGS = {
    "radix-lpm": dict(),
    "overlap-loop": dict(disable_overlap_schedule=False),
    "overlap-loop-retracts": dict(disable_overlap_schedule=False, max_total_tokens=100, init_new_token_ratio=0.1,
                                  min_new_token_ratio=0.05),
    "overlap-chunk7-mixed": dict(disable_overlap_schedule=False, chunked_prefill_size=7, enable_mixed_chunk=True),
    "radix-dfs-weight": dict(schedule_policy="dfs-weight"),
    "radix-fcfs-chunk1": dict(schedule_policy="fcfs", chunked_prefill_size=1),
    "radix-fcfs-chunk7": dict(schedule_policy="fcfs", chunked_prefill_size=7),
    "radix-chunk64-mixed": dict(chunked_prefill_size=64, enable_mixed_chunk=True),
    "radix-no-chunking": dict(chunked_prefill_size=-1),
    "radix-lof-mixed-chunk5": dict(schedule_policy="lof", chunked_prefill_size=5, enable_mixed_chunk=True),
    "radix-random": dict(schedule_policy="random"),
    "no-radix": dict(disable_radix_cache=True),
    "no-radix-chunk3": dict(disable_radix_cache=True, chunked_prefill_size=3, max_prefill_tokens=8),
    "tiny-pool-retracts": dict(max_total_tokens=100, init_new_token_ratio=0.1, min_new_token_ratio=0.05),
    # Decoding requests outgrow their reservations while a prompt is prefilled in chunks: the next chunk must
    # take only the room there is (it once asked for more and the scheduler died of an exhausted pool).
    "tiny-pool-chunk5-retracts": dict(max_total_tokens=100, chunked_prefill_size=5, init_new_token_ratio=0.1,
                                      min_new_token_ratio=0.05),
    "tiny-pool-chunk5-mixed-retracts": dict(max_total_tokens=100, chunked_prefill_size=5, enable_mixed_chunk=True,
                                            init_new_token_ratio=0.1, min_new_token_ratio=0.05),
}


@pytest.fixture(scope="module")
def config_engine(tiny_model_dirs):
    """The engine for a name in CONFIGS. Engines start two at a time, side by side (a start is mostly one core's
    work): asking for one also starts the next config's, which waits, idle, for its own test."""
    waiting: dict[str, Engine] = {}
    asked: set[str] = set()

    def args(name: str) -> dict:
        return {**EXACT, **NO_GRAMMAR, "max_total_tokens": 3000, "torch_num_threads": 2, **CONFIGS[name]}

    def get(name: str) -> Engine:
        asked.add(name)
        if name not in waiting:
            following = [n for n in sorted(CONFIGS) if n > name and n not in asked and n not in waiting][:1]
            names = [name, *following]
            waiting.update(zip(names, start_side_by_side(*[(str(tiny_model_dirs["llama"]), args(n))
                                                           for n in names])))
        return waiting.pop(name)

    yield get
    shut_down(list(waiting.values()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_hf_under_every_cache_and_schedule(name, config_engine, expected):
    prompts, lengths, reference = expected
    with config_engine(name) as engine:
        params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
        first = engine.generate(prompts, params)
        assert [r["output_ids"] for r in first] == reference
        again = engine.generate(prompts[:3], params[:3])  # now served from the cache, when there is one
        assert [r["output_ids"] for r in again] == reference[:3]
        stats = engine.get_stats()
        if name.endswith("retracts"):
            assert stats["num_retractions"] > 0, "the tiny pool was meant to force retraction"
            assert stats["evicted_tokens"] > 0, "the tiny pool was meant to force eviction"
        if "no-radix" in name:
            assert stats["cached_tokens_total"] == 0
        else:
            assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)
        assert_pool_free(engine)


def test_cached_tokens_reports_the_hit(engine, tokenizer):
    prompt = SHARED + "first question"
    ids = tokenizer.encode(prompt)
    cold = engine.generate(prompt, {**GREEDY, "max_new_tokens": 4})
    warm = engine.generate(prompt, {**GREEDY, "max_new_tokens": 4})
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == len(ids) - 1  # the last token is recomputed for its logits
    assert warm["output_ids"] == cold["output_ids"]
    sibling = engine.generate(SHARED + "second question", {**GREEDY, "max_new_tokens": 4})
    assert sibling["meta_info"]["cached_tokens"] >= len(tokenizer.encode(SHARED)) - 1


def test_prompt_logprobs_are_exact_on_a_cached_prompt(engine, hf_reference, tokenizer):
    prompt = SHARED + "logprob check"
    ids = tokenizer.encode(prompt)
    engine.generate(prompt, {**GREEDY, "max_new_tokens": 1})
    out = engine.generate(prompt, {**GREEDY, "max_new_tokens": 2}, return_logprob=True, logprob_start_len=3)
    reference = hf_reference("llama").logprobs(ids)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[3:]
    for position, (logprob, token, _) in zip(range(3, len(ids)), entries):
        assert abs(logprob - reference[position - 1, token].item()) < 1e-4
    assert out["meta_info"]["cached_tokens"] <= 2


def test_waiting_siblings_share_one_prefill(engine, tokenizer):
    """Siblings sharing an uncached prefix: one computes it, the rest hit the cache it filled."""
    prompts = branch_prompts(4, seed=11)
    assert engine.flush_cache()  # nothing cached, as on a new engine
    results = engine.generate(prompts, {**GREEDY, "max_new_tokens": 3})
    shared = len(tokenizer.encode(SHARED))
    hits = sorted(r["meta_info"]["cached_tokens"] for r in results)
    assert hits[0] == 0 and all(h >= shared - 2 for h in hits[1:]), hits


def test_chunked_prefill_logprobs_match_unchunked(tiny_model_dirs, tokenizer):
    prompt = SHARED + "chunked"
    params = {**GREEDY, "max_new_tokens": 5}
    args = {**EXACT, **NO_GRAMMAR, "max_total_tokens": 2000, "torch_num_threads": 2}
    runs = []
    with engines_side_by_side(*[(str(tiny_model_dirs["llama"]), {**args, "chunked_prefill_size": chunk})
                                for chunk in (-1, 4)]) as engines:
        for engine in engines:
            runs.append(engine.generate(prompt, params, return_logprob=True, logprob_start_len=0,
                                        top_logprobs_num=2))
            assert_pool_free(engine)
    whole, chunked = runs
    assert chunked["output_ids"] == whole["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        a, b = whole["meta_info"][key], chunked["meta_info"][key]
        assert [t for _, t, _ in a] == [t for _, t, _ in b]
        assert all((x is None and y is None) or abs(x - y) < 1e-4 for (x, _, _), (y, _, _) in zip(a, b))
    assert len(chunked["meta_info"]["input_top_logprobs"]) == len(tokenizer.encode(prompt))
