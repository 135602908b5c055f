"""Jump-forward appends what greedy constrained decoding without it would have produced: the forced text encoded as
the tokenizer encodes it, its last token left to the model (jump_forward.py says why).

The comparison runs under the default grammar backend, whose masks (llguidance's, for JSON schemas and regexes) admit
only the tokenizer's own tokens for forced text, so the model's greedy path through forced text is that encoding.
Under masks that admit every split (xgrammar's) a small model sometimes takes its own (`c` `it` `y` for `city`),
which nothing short of running the model can predict."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import EXACT, assert_pool_free
from furcate import Engine
from furcate.runtime.scheduler.plugins.jump_forward import forced_tokens


def pieces(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def test_forced_text_is_encoded_whole_and_its_last_token_held_back(tokenizer):
    # `": ` alone ends in a lone space; followed by a string value the model writes `":` ` "`.
    assert pieces(tokenizer, forced_tokens(tokenizer, '": ', limit=100)) == ['":']
    assert pieces(tokenizer, forced_tokens(tokenizer, '"name": "', limit=100)) == ['"', "name", '":']
    assert pieces(tokenizer, forced_tokens(tokenizer, ", call me", limit=100)) == [",", " call"]


def test_one_token_of_forced_text_is_left_to_the_model(tokenizer):
    assert forced_tokens(tokenizer, '"', limit=100) == []
    assert forced_tokens(tokenizer, "", limit=100) == []


def test_the_limit_bounds_what_is_appended(tokenizer):
    assert pieces(tokenizer, forced_tokens(tokenizer, '"name": "', limit=2)) == ['"', "name"]
    assert forced_tokens(tokenizer, '"name": "', limit=0) == []


def test_never_cut_inside_a_character(tokenizer):
    text = "日本語のテキスト"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for limit in range(len(tokens)):
        appended = forced_tokens(tokenizer, text, limit)
        decoded = tokenizer.decode(appended)
        assert text.startswith(decoded) and "\ufffd" not in decoded


# -- against greedy decoding without jump-forward, on the default model -----------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]},
                                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "color", "tags", "ok"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["city", "country", "population"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"},
                                         "genres": {"type": "array",
                                                    "items": {"enum": ["fiction", "science", "history"]}}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}
REGEXES = [r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no)\. Confidence: \d{2}%"]
QUESTIONS = {"json_schema": ["Describe a person as JSON.", "Give me a JSON object for an item.", "A city in JSON.",
                             "Describe your favourite book as JSON."],
             "regex": ["Your phone number?", "Is the sky blue? Answer with your confidence."]}
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def cases(tokenizer) -> list[tuple[str, dict]]:
    """(prompt, sampling params): each schema and regex under a plain and a chat prompt, greedy."""
    def chat(question: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)

    base = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    specs = [("json_schema", json.dumps(schema)) for schema in (PERSON, ITEM, CITY, BOOK)]
    specs += [("regex", regex) for regex in REGEXES]
    questions = {kind: iter(texts) for kind, texts in QUESTIONS.items()}
    found = []
    for kind, spec in specs:
        question = next(questions[kind])
        found += [(prompt, {**base, kind: spec}) for prompt in (question, chat(question))]
    return found


@pytest.fixture(scope="module")
def reference_and_overlap_engine(cases) -> tuple[list[list[int]], Engine]:
    """What greedy constrained decoding gives without jump-forward (from an engine shut down once it answered),
    and an engine on the overlapped loop; the two start side by side (a start is mostly one core's work)."""
    args = {**EXACT, "max_total_tokens": 4096, "torch_num_threads": 2}
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Engine, "default", **args, disable_overlap_schedule=False)
        try:
            with Engine("default", **args, disable_jump_forward=True) as engine:
                results = engine.generate([p for p, _ in cases], [params for _, params in cases])
                assert_pool_free(engine)
        except BaseException:
            if starting.exception() is None:
                starting.result().shutdown()
            raise
    with starting.result() as overlap_engine:
        yield [r["output_ids"] for r in results], overlap_engine


@pytest.fixture(scope="module")
def reference(reference_and_overlap_engine) -> list[list[int]]:
    return reference_and_overlap_engine[0]


@pytest.fixture(scope="module")
def overlap_engine(reference_and_overlap_engine) -> Engine:
    return reference_and_overlap_engine[1]


def generate_and_check(engine: Engine, cases: list[tuple[str, dict]], one_at_a_time: bool) -> list[list[int]]:
    """Output ids for `cases`, as one batch or one request at a time; asserts jump-forward ran and freed its KV."""
    jumped_before = engine.get_stats()["jumped_tokens"]
    if one_at_a_time:
        results = [engine.generate(prompt, params) for prompt, params in cases]
    else:
        results = engine.generate([p for p, _ in cases], [params for _, params in cases])
    assert engine.get_stats()["jumped_tokens"] > jumped_before
    assert_pool_free(engine)
    return [r["output_ids"] for r in results]


@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["batch", "batch-1"])
def test_plain_loop_matches_decoding_without_jump_forward(default_engine, cases, reference, one_at_a_time):
    assert generate_and_check(default_engine, cases, one_at_a_time) == reference


def test_overlap_loop_matches_decoding_without_jump_forward(overlap_engine, cases, reference):
    assert generate_and_check(overlap_engine, cases, one_at_a_time=False) == reference
