"""The runtime's greedy output is HF transformers' greedy output, token for token, for every architecture."""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import ARCHS, EXACT, NO_GRAMMAR, assert_pool_free, engine_starting
from furcate import Engine

WORDS = "the a river of stone light over quiet 7 42 hills and when, old machines sang; 3.14 never".split()


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # Lengths from 1 word to well past the mistral model's 24-token sliding window.
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_and_staggered_greedy_equal_hf(arch, tiny_model_dirs, hf_reference, tokenizer):
    prompts = make_prompts(10, seed=ARCHS.index(arch))
    lengths = [4 + 3 * i for i in range(len(prompts))]
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths]
    # A small request limit and pool make requests queue and join the running decode batch as others finish.
    with engine_starting(str(tiny_model_dirs[arch]), **EXACT, **NO_GRAMMAR, max_total_tokens=1500,
                         max_running_requests=4, torch_num_threads=2) as started:
        hf = hf_reference(arch)  # while the engine starts
        expected = [hf.greedy(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]
        engine = started()
        together = engine.generate(prompts, params)
        assert [r["output_ids"] for r in together] == expected
        staggered = asyncio.run(generate_staggered(engine, prompts, params))
        assert [r["output_ids"] for r in staggered] == expected
        assert_pool_free(engine)


async def generate_staggered(engine: Engine, prompts: list[str], params: list[dict]) -> list[dict]:
    async def one(i: int) -> dict:
        await asyncio.sleep(0.03 * i)
        return await engine.async_generate(prompts[i], params[i])

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def test_input_ids_and_text_agree(engine, tokenizer):
    prompt = "old machines sang over the river"
    by_text = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0})
    by_ids = engine.generate(input_ids=tokenizer.encode(prompt), sampling_params={"max_new_tokens": 6,
                                                                                  "temperature": 0})
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_repetition_penalty_matches_hf(engine, hf_reference, tokenizer):
    ids = tokenizer.encode("the river the river the river of stone")
    expected = hf_reference("llama").greedy(ids, 12, repetition_penalty=1.5)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                          "repetition_penalty": 1.5, "ignore_eos": True})
    assert out["output_ids"] == expected


def test_pool_sized_below_one_request_still_serves_in_turn(tiny_model_dirs, hf_reference, tokenizer):
    """Requests that together exceed the KV pool wait for memory instead of failing."""
    prompts = make_prompts(6, seed=99)
    with engine_starting(str(tiny_model_dirs["llama"]), **EXACT, **NO_GRAMMAR, max_total_tokens=128,
                         torch_num_threads=2) as started:
        hf = hf_reference("llama")  # while the engine starts
        expected = [hf.greedy(tokenizer.encode(p), 20) for p in prompts]
        engine = started()
        out = engine.generate(prompts, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert [r["output_ids"] for r in out] == expected
        assert_pool_free(engine)
