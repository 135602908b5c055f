"""grammar_backend="auto" (the default) in a running engine: it serves every kind of constraint; a schema no backend
enforces exactly fails alone with an error naming the keyword, unless the request allows an approximation; a backend
named explicitly serves its approximations."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import EXACT, assert_pool_free
from furcate import Engine
from furcate.runtime.config import EngineArgs

# Every value is bounded, so each output closes well within its token budget and is checked on every run.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# No backend enforces uniqueItems: llguidance refuses it strictly, xgrammar and outlines-core ignore it.
UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "uniqueItems": True,
          "maxItems": 3}
GREEDY = {"temperature": 0.0, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def auto_engine(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=3000, torch_num_threads=2) as engine:
        yield engine


def test_auto_is_the_default():
    assert EngineArgs().grammar_backend == "auto"


def test_auto_serves_every_kind(auto_engine):
    people = auto_engine.generate(["A person:"] * 3, [{**GREEDY, "json_schema": PERSON, "temperature": 1.0,
                                                       "sampling_seed": seed} for seed in range(3)])
    for person in people:
        jsonschema.validate(json.loads(person["text"]), PERSON)
    phone = auto_engine.generate("Call", {**GREEDY, "regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", phone["text"], flags=re.ASCII)  # furcate's \d is ASCII
    laugh = auto_engine.generate("Say", {**GREEDY, "ebnf": 'root ::= ("ha" | "ho"){1,3} "!"'})
    assert re.fullmatch(r"(ha|ho){1,3}!", laugh["text"])
    colour = auto_engine.generate("Pick:", {**GREEDY, "choices": ["red", "green", "blue"]})
    assert colour["text"] in ("red", "green", "blue")
    assert_pool_free(auto_engine)


def test_inexact_schema_fails_alone_unless_approximation_is_allowed(auto_engine):
    with pytest.raises(ValueError, match="cannot be enforced exactly.*uniqueItems.*allow_approximate_schema"):
        auto_engine.generate("Numbers:", {**GREEDY, "json_schema": UNIQUE})
    allowed = auto_engine.generate("Numbers:", {**GREEDY, "json_schema": UNIQUE, "allow_approximate_schema": True})
    assert isinstance(json.loads(allowed["text"]), list)
    with pytest.raises(ValueError, match="allow_approximate_schema must be true or false"):
        auto_engine.generate("x", {**GREEDY, "json_schema": UNIQUE, "allow_approximate_schema": "yes"})
    assert auto_engine.generate("still serving", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3
    assert_pool_free(auto_engine)


def test_named_backend_serves_its_approximation(tiny_model_dirs):
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=2000, torch_num_threads=2,
                grammar_backend="llguidance") as engine:
        assert isinstance(json.loads(engine.generate("Numbers:", {**GREEDY, "json_schema": UNIQUE})["text"]), list)
        person = engine.generate("A person:", {**GREEDY, "json_schema": PERSON})
        jsonschema.validate(json.loads(person["text"]), PERSON)
        assert_pool_free(engine)
