"""Every backend says whether it enforces a spec exactly, and what it approximates; these tests also pin the
behaviour behind each claim (an ignored keyword really is ignored), so a backend upgrade that changes it shows here.
grammar_backend="auto" picks the first exact backend per kind."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from furcate.grammars.auto import AutoBackend
from furcate.grammars.base import GrammarSpec
from furcate.grammars.formats import PROBES
from furcate.grammars.regex_dialect import with_ascii_classes
from furcate.grammars.registry import make_backend
from furcate.grammars.schema_keywords import anchored_at_both_ends, constraint_uses, schemas_in
from furcate.grammars.xgrammar_backend import native_warnings

STOP = 2
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
OVERLAPPING_ONE_OF = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}
OPEN_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def backends(tokenizer):
    return {name: make_backend(name, tokenizer, tokenizer.vocab_size, [STOP], compile_timeout_s=60)
            for name in ("xgrammar", "llguidance", "outlines", "auto")}


def schema(backends, name: str, value):
    return backends[name].compile(GrammarSpec("json_schema", json.dumps(value)))


def accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.accept(STOP) and matcher.is_terminated()


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_plain_schemas_and_simple_specs_are_exact(backends, name):
    assert schema(backends, name, {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": False}).fidelity.exact
    assert backends[name].compile(GrammarSpec("regex", r"[0-9]{3}-[a-z]+")).fidelity.exact
    assert backends[name].compile(GrammarSpec("choices", json.dumps(["a", "b c"]))).fidelity.exact


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_ignored_keyword_is_named_and_really_ignored(backends, tokenizer, name):
    compiled = schema(backends, name, UNIQUE)
    assert any("uniqueItems" in entry for entry in compiled.fidelity.approximations), compiled.fidelity
    assert accepts(compiled, tokenizer, "[1, 1]")


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_overlapping_one_of_is_named_and_really_any_of(backends, tokenizer, name):
    compiled = schema(backends, name, OVERLAPPING_ONE_OF)
    assert any("oneOf" in entry for entry in compiled.fidelity.approximations), compiled.fidelity
    assert accepts(compiled, tokenizer, '"ab"')  # matches both branches: invalid under oneOf


def test_xgrammar_and_llguidance_allow_unlisted_properties_outlines_says_it_does_not(backends, tokenizer):
    for name in ("xgrammar", "llguidance"):
        compiled = schema(backends, name, OPEN_OBJECT)
        assert compiled.fidelity.exact and accepts(compiled, tokenizer, '{"a": 1, "b": 2}'), name
    for value in (OPEN_OBJECT, {**OPEN_OBJECT, "additionalProperties": True}):
        outlines = schema(backends, "outlines", value)
        assert "additionalProperties" in outlines.fidelity.describe()
        assert accepts(outlines, tokenizer, '{"a": 1}') and not accepts(outlines, tokenizer, '{"a": 1, "b": 2}')


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_whole_string_patterns_are_named(backends, tokenizer, name):
    """JSON Schema searches a pattern anywhere in the string; these backends match it against the whole string."""
    compiled = schema(backends, name, {"type": "string", "pattern": "b+"})
    assert "pattern 'b+'" in compiled.fidelity.describe()
    assert accepts(compiled, tokenizer, '"bb"') and not accepts(compiled, tokenizer, '"abbc"')
    assert schema(backends, name, {"type": "string", "pattern": "^b+$"}).fidelity.exact


def test_xgrammar_warnings_become_approximations(backends, tokenizer):
    both = schema(backends, "xgrammar", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3})
    assert "ignoring minLength/maxLength" in both.fidelity.describe()
    assert accepts(both, tokenizer, '"abcdef"')
    lookahead = schema(backends, "xgrammar", {"type": "string", "pattern": "^(?=a)[ab]+$"})
    assert "Lookahead assertion is not supported and is ignored" in lookahead.fidelity.describe()
    assert accepts(lookahead, tokenizer, '"ba"')


@pytest.mark.parametrize(("regex", "text", "accepted"), [(".", "\n", False), (r"\d", "\u0663", False),
                                                       (r"\w", "\u00e9", False), (r"\d", "7", True),
                                                       (r"[\dx]+", "7x", True), (r"\D", "\u0663", True)])
def test_regex_dialect_is_python_with_ascii_classes(backends, tokenizer, regex, text, accepted):
    """The regex kind is Python's `re` with ASCII `\\d` and `\\w` (regex_dialect.py): every backend agrees on these,
    except xgrammar's `.`, which takes a newline, and says so."""
    assert bool(re.fullmatch(regex, text, flags=re.ASCII)) == accepted
    for name in ("llguidance", "outlines", "xgrammar"):
        compiled = backends[name].compile(GrammarSpec("regex", regex))
        if name == "xgrammar" and regex == ".":
            assert not compiled.fidelity.exact and accepts(compiled, tokenizer, text) != accepted
        else:
            assert compiled.fidelity.exact and accepts(compiled, tokenizer, text) == accepted, name


@pytest.mark.parametrize(("regex", "rewritten", "departures"), [
    (r"\d{3}-\w+", "[0-9]{3}-[0-9A-Za-z_]+", 0), (r"[\d.]", "[0-9.]", 0), (r"\\d", r"\\d", 0),
    (r"[]\d]", "[]0-9]", 0), (r"[^]\w]\D", "[^]0-9A-Za-z_][^0-9]", 0), (r"[\D]", r"[\D]", 1), (r"\.\s", r"\.\s", 0)])
def test_ascii_classes_rewrite(regex, rewritten, departures):
    assert with_ascii_classes(regex) == (rewritten, [with_ascii_classes(r"[\D]")[1][0]] * departures)
    sample = "7a_é\u0663]"
    for text in (sample[i:j] for i in range(len(sample)) for j in range(i, len(sample) + 1)):
        if not departures:
            assert bool(re.fullmatch(regex, text, re.ASCII)) == bool(re.fullmatch(rewritten, text)), text


def test_outlines_free_values_are_named(backends, tokenizer):
    """outlines-core 0.2.14 leaves a `{}` property's alternation ungrouped: the object takes no value at all."""
    compiled = schema(backends, "outlines", {"type": "object", "properties": {"a": {}}, "required": ["a"]})
    assert "values without a schema" in compiled.fidelity.describe()
    assert not accepts(compiled, tokenizer, '{"a": 1}')
    assert schema(backends, "llguidance", {"type": "object", "properties": {"a": {}}}).fidelity.exact


def test_outlines_pattern_classes_are_unicode(backends, tokenizer):
    """JSON Schema's \\d is ASCII (ECMA-262); outlines-core's takes any Unicode digit, and says so."""
    compiled = schema(backends, "outlines", {"type": "string", "pattern": "^\\d+$"})
    assert "\\d and \\w match any Unicode" in compiled.fidelity.describe()
    assert accepts(compiled, tokenizer, '"\u0663"')
    assert schema(backends, "llguidance", {"type": "string", "pattern": "^\\d+$"}).fidelity.exact


def test_xgrammar_unknown_format_is_named(backends):
    # A format JSON Schema defines and xgrammar does not implement is named; any other format is an annotation,
    # which constrains nothing (rewrites.py drops it), so every backend is exact on it.
    assert "format 'iri': not enforced" in schema(backends, "xgrammar", {"type": "string",
                                                                       "format": "iri"}).fidelity.describe()
    for name in ("xgrammar", "llguidance", "outlines"):
        assert schema(backends, name, {"type": "string", "format": "furcate-x"}).fidelity.exact, name
    assert schema(backends, "xgrammar", {"type": "string", "format": "date"}).fidelity.exact


def test_other_threads_stderr_survives_the_capture(capfd):
    with native_warnings() as warnings:
        os.write(2, b"an unrelated line\n")
    assert warnings == [] and "an unrelated line" in capfd.readouterr().err


def test_auto_picks_the_first_exact_backend(backends):
    assert schema(backends, "auto", OPEN_OBJECT).fidelity.backend == "llguidance"
    assert backends["auto"].compile(GrammarSpec("ebnf", 'root ::= "a"+')).fidelity.backend == "xgrammar"
    assert backends["auto"].compile(GrammarSpec("regex", r"[a-z]+\d")).fidelity.backend == "llguidance"
    assert backends["auto"].compile(GrammarSpec("choices", '["a", "b"]')).fidelity.backend == "llguidance"
    approximate = schema(backends, "auto", UNIQUE)
    assert not approximate.fidelity.exact and "uniqueItems" in approximate.fidelity.describe()


def test_auto_falls_back_to_the_next_exact_backend(backends):
    # llguidance 1.5 does not implement the uri format (it only approximates it, leniently); xgrammar does, and its
    # grammar refuses every string the probes say uri forbids.
    uri = {"type": "object", "properties": {"link": {"type": "string", "format": "uri"}}}
    assert "Unknown format: uri" in schema(backends, "llguidance", uri).fidelity.describe()
    assert schema(backends, "xgrammar", uri).fidelity.exact
    assert schema(backends, "auto", uri).fidelity.backend == "xgrammar"


def test_auto_names_every_backend_when_none_compiles(backends):
    with pytest.raises(ValueError, match="does not compile with any grammar backend.*llguidance.*xgrammar"):
        schema(backends, "auto", {"type": "object", "properties": 5})
    assert isinstance(backends["auto"], AutoBackend)


def test_schema_walk_sees_subschemas_not_data():
    value = {"properties": {"not": {"format": "email"}, "enum": {"enum": [{"pattern": "x"}]}},
             "items": [{"minLength": 0}], "default": {"uniqueItems": True}}
    assert [node for node in schemas_in(value)][1:] == [{"minLength": 0}, {"format": "email"},
                                                        {"enum": [{"pattern": "x"}]}]
    assert constraint_uses(value) == [("format", "email"), ("enum", None)]  # minLength 0 constrains nothing
    assert constraint_uses({"exclusiveMinimum": 0}) == [("exclusiveMinimum", None)]  # a bound, though 0 == False
    assert anchored_at_both_ends("^(a|b)$") and not anchored_at_both_ends("^a|b$") and not anchored_at_both_ends("a$")


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_dates_are_exact_everywhere(backends, tokenizer, name):
    """Each backend's own date grammar lets impossible days through (February 29 of 2021 at least); the schemas
    reach them with date and date-time as exact patterns instead."""
    date = schema(backends, name, {"type": "string", "format": "date"})
    assert date.fidelity.exact, date.fidelity
    assert [accepts(date, tokenizer, json.dumps(day)) for day in ("2024-02-29", "2000-02-29", "2021-02-29",
                                                                 "1900-02-29", "2022-04-31", "2022-12-31")] == [
        True, True, False, False, False, True]
    moment = schema(backends, name, {"type": "string", "format": "date-time"})
    assert accepts(moment, tokenizer, '"2024-02-29T23:59:60.5+01:00"')
    assert not accepts(moment, tokenizer, '"2021-02-29T10:00:00Z"')


def test_format_probes_are_forbidden_strings():
    """Where jsonschema checks a format itself, it agrees that every probe breaks it."""
    checker = jsonschema.FormatChecker()
    for fmt in set(PROBES) & {"date", "ipv4", "ipv6", "uuid"}:
        assert not [probe for probe in PROBES[fmt] if checker.conforms(probe, fmt)], fmt


def test_xgrammar_format_that_lets_a_forbidden_string_through_is_named(backends, tokenizer):
    compiled = schema(backends, "xgrammar", {"type": "string", "format": "ipv4"})
    assert "format 'ipv4': accepts '01.1.1.1'" in compiled.fidelity.describe()
    assert accepts(compiled, tokenizer, '"01.1.1.1"')
    assert schema(backends, "llguidance", {"type": "string", "format": "ipv4"}).fidelity.exact
