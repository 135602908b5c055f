"""Constrained decoding: outputs finished by the grammar satisfy their spec; bad specs fail alone; the
overlapped loop and the plain loop agree."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from pydantic import BaseModel

from conftest import EXACT, assert_pool_free, engines_side_by_side
from furcate import Engine
from furcate.grammars.base import GrammarSpec, allocate_bitmask
from furcate.grammars.registry import make_backend
from furcate.runtime.scheduler.plugins.grammar_queue import percentile

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
RANDOM = {"temperature": 1.0, "max_new_tokens": 64}


class City(BaseModel):
    name: str
    population: int


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_mask_allows_exactly_what_the_matcher_accepts(backend_name, tokenizer):
    backend = make_backend(backend_name, tokenizer, tokenizer.vocab_size, [2], compile_timeout_s=30)
    matcher = backend.compile(GrammarSpec("regex", r"(yes|no)!")).matcher()
    bitmask = allocate_bitmask(1, tokenizer.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(tokenizer.vocab_size)]
    allowed = {t for t, bit in enumerate(bits) if bit}
    assert tokenizer.encode("yes")[0] in allowed and tokenizer.encode("no")[0] in allowed
    assert tokenizer.encode("maybe")[0] not in allowed
    for token in tokenizer.encode("no!"):
        assert matcher.accept(token)
    assert matcher.accept(2) and matcher.is_terminated()


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_bad_specs_are_clear_errors(backend_name, tokenizer):
    backend = make_backend(backend_name, tokenizer, tokenizer.vocab_size, [2], compile_timeout_s=30)
    with pytest.raises(ValueError, match="regex"):
        backend.compile(GrammarSpec("regex", "(unclosed"))


def test_length_bounded_strings_are_json_strings(tokenizer):
    """xgrammar's own lowering of maxLength admits raw control characters, which JSON forbids; ours does not."""
    backend = make_backend("xgrammar", tokenizer, tokenizer.vocab_size, [2], compile_timeout_s=30)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 4})))

    def accepts(text: str) -> bool:
        matcher = compiled.matcher()
        return all(matcher.accept(t) for t in tokenizer.encode(text) + [2]) and matcher.is_terminated()

    assert accepts('"abcd"') and accepts('"a b"')
    assert not accepts('"abcde"') and not accepts('"a\tb"') and not accepts('"\x03"')


LLAMA_ENGINES = {"overlap": {"disable_overlap_schedule": False}, "plain": {"disable_overlap_schedule": True},
                 "no-jump-forward": {"disable_jump_forward": True}}


@pytest.fixture(scope="module")
def llama_engines(tiny_model_dirs) -> dict[str, Engine]:
    """The module's tiny llama engines (LLAMA_ENGINES), started side by side."""
    args = {**EXACT, "max_total_tokens": 4000, "torch_num_threads": 2}
    with engines_side_by_side(*[(str(tiny_model_dirs["llama"]), {**args, **extra})
                                for extra in LLAMA_ENGINES.values()]) as engines:
        yield dict(zip(LLAMA_ENGINES, engines))


@pytest.fixture(scope="module", params=["overlap", "plain"])
def grammar_engine(request, llama_engines) -> Engine:
    return llama_engines[request.param]


def finished_by_grammar(result: dict) -> bool:
    return result["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_outputs_validate(grammar_engine):
    params = [{**RANDOM, "json_schema": PERSON, "sampling_seed": seed} for seed in range(6)]
    results = grammar_engine.generate(["Describe a person as JSON:"] * 6, params)
    finished = [r for r in results if finished_by_grammar(r)]
    assert finished, "some outputs should close their JSON within 64 tokens"
    for result in finished:
        jsonschema.validate(json.loads(result["text"]), PERSON)
    stats = grammar_engine.get_stats()
    decoded = sum(r["meta_info"]["completion_tokens"] for r in results) - stats["jumped_tokens"]
    assert stats["grammar_compiles"] >= 1 and stats["mask_fills"] >= decoded - len(finished)
    assert stats["mask_fill_p99_us"] >= stats["mask_fill_p50_us"] > 0
    assert_pool_free(grammar_engine)


def test_percentile_is_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99 and percentile(list(range(1, 101)), 100) == 100


def test_pydantic_schema_and_regex_and_choices(grammar_engine):
    city = grammar_engine.generate("A city:", {**RANDOM, "json_schema": City, "sampling_seed": 3})
    if finished_by_grammar(city):
        City.model_validate_json(city["text"])
    phone = grammar_engine.generate("Call", {**RANDOM, "regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", phone["text"])
    answers = grammar_engine.generate(["Pick:"] * 4, [{**RANDOM, "choices": ["red", "green", "blue"],
                                                       "sampling_seed": s} for s in range(4)])
    assert all(a["text"] in ("red", "green", "blue") for a in answers)
    assert_pool_free(grammar_engine)


@pytest.mark.parametrize("no_jump_forward", [False, True], ids=["jump-forward", "no-jump-forward"])
def test_greedy_constrained_outputs_agree_across_loops(tiny_model_dirs, no_jump_forward):
    prompts = ["Describe a person as JSON:", "Person:", "{"]
    params = {"temperature": 0.0, "max_new_tokens": 40, "json_schema": PERSON}
    args = {**EXACT, "max_total_tokens": 2000, "torch_num_threads": 2, "disable_jump_forward": no_jump_forward}
    loops = [(str(tiny_model_dirs["qwen3"]), {**args, "disable_overlap_schedule": plain}) for plain in (False, True)]
    with engines_side_by_side(*loops) as engines:
        outputs = [[r["output_ids"] for r in engine.generate(prompts, params)] for engine in engines]
    assert outputs[0] == outputs[1]


def test_bad_schema_fails_only_its_request(grammar_engine):
    with pytest.raises(ValueError, match="json_schema"):
        grammar_engine.generate("x", {**RANDOM, "json_schema": {"type": "object", "properties": 5}})
    with pytest.raises(ValueError, match="regex"):
        grammar_engine.generate("x", {**RANDOM, "regex": "(unclosed"})
    with pytest.raises(ValueError, match="at most one"):
        grammar_engine.generate("x", {**RANDOM, "regex": "a", "choices": ["a"]})
    assert grammar_engine.generate("still serving", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3
    assert_pool_free(grammar_engine)


def assert_valid_and_jumped(engine: Engine, jumps: bool) -> None:
    jumped_before = engine.get_stats()["jumped_tokens"]
    results = engine.generate(["Person:"] * 3, [{**RANDOM, "json_schema": PERSON, "sampling_seed": s}
                                                for s in range(3)])
    for result in results:
        if finished_by_grammar(result):
            jsonschema.validate(json.loads(result["text"]), PERSON)
    assert (engine.get_stats()["jumped_tokens"] > jumped_before) == jumps
    assert_pool_free(engine)


def test_jump_forward_keeps_outputs_valid(grammar_engine):
    """Jump-forward is on by default: the module's engines (plain and overlapped loop) take it."""
    assert_valid_and_jumped(grammar_engine, jumps=True)


def test_outputs_stay_valid_without_jump_forward(llama_engines):
    assert_valid_and_jumped(llama_engines["no-jump-forward"], jumps=False)


def test_outlines_compile_limit_fails_only_slow_grammars(tiny_model_dirs):
    """Each compile gets the full timeout from when it starts, so a grammar queued behind slow ones still runs."""
    exploding = {"regex": "(a|b)*a(a|b){24}", "max_new_tokens": 4}
    simple = {"regex": "(yes|no)", "temperature": 0.0, "max_new_tokens": 4}

    async def run(engine):
        return await asyncio.gather(*(engine.async_generate("x", params) for params in [exploding] * 3 + [simple]),
                                    return_exceptions=True)

    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=2000, torch_num_threads=2,
                grammar_backend="outlines", grammar_compile_timeout=3) as engine:
        *slow, fine = asyncio.run(run(engine))
        assert all(isinstance(error, ValueError) and "within 3s" in str(error) for error in slow), slow
        assert fine["text"] in ("yes", "no")
        assert_pool_free(engine)
