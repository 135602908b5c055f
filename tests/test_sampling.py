"""Random sampling through the engine: seeds reproduce, n > 1 expands, filters behave."""

from __future__ import annotations

PROMPT = "when old machines sang"
RANDOM = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}


def test_same_seed_same_output_even_in_a_different_batch(engine):
    alone = engine.generate(PROMPT, {**RANDOM, "sampling_seed": 7})
    again = engine.generate(PROMPT, {**RANDOM, "sampling_seed": 7})
    batched = engine.generate([PROMPT, "other text", PROMPT], [{**RANDOM, "sampling_seed": 3},
                                                              {**RANDOM, "sampling_seed": 9},
                                                              {**RANDOM, "sampling_seed": 7}])
    assert alone["output_ids"] == again["output_ids"] == batched[2]["output_ids"]
    other_seed = engine.generate(PROMPT, {**RANDOM, "sampling_seed": 8})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPT, {**RANDOM, "temperature": 0.0})
    top1 = engine.generate(PROMPT, {**RANDOM, "top_k": 1, "sampling_seed": 1})
    assert top1["output_ids"] == greedy["output_ids"]


def test_tiny_top_p_is_greedy(engine):
    greedy = engine.generate(PROMPT, {**RANDOM, "temperature": 0.0})
    nucleus = engine.generate(PROMPT, {**RANDOM, "top_p": 1e-6, "sampling_seed": 2})
    assert nucleus["output_ids"] == greedy["output_ids"]


def test_n_returns_n_distinct_samples_in_order(engine):
    results = engine.generate([PROMPT, "the river"], {**RANDOM, "n": 3, "sampling_seed": 11})
    assert len(results) == 6
    assert len({tuple(r["output_ids"]) for r in results[:3]}) == 3
    single = engine.generate(PROMPT, {**RANDOM, "sampling_seed": 12})
    assert results[1]["output_ids"] == single["output_ids"]


def test_unseeded_requests_differ(engine):
    outs = engine.generate([PROMPT] * 3, RANDOM)
    assert len({tuple(o["output_ids"]) for o in outs}) == 3
