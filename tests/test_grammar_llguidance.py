"""The llguidance backend behind furcate's matcher protocol: its mask is exactly what its matcher accepts, in our
packed layout; stop tokens, rollback and jump-forward behave as the scheduler expects; bad specs are clear errors;
our EBNF reaches it with its language unchanged."""

from __future__ import annotations

import itertools
import json

import llguidance
import pytest
import torch

from furcate.grammars.base import GrammarSpec, allocate_bitmask
from furcate.grammars.ebnf_to_lark import ebnf_to_lark
from furcate.grammars.registry import make_backend

STOPS = [2, 0]  # <|im_end|> first (llguidance's own stop token), <|endoftext|> as a second one


@pytest.fixture(scope="module")
def backend(tokenizer):
    return make_backend("llguidance", tokenizer, tokenizer.vocab_size, STOPS, compile_timeout_s=30)


@pytest.fixture(scope="module")
def xgrammar(tokenizer):
    return make_backend("xgrammar", tokenizer, tokenizer.vocab_size, STOPS, compile_timeout_s=30)


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:vocab_size]).flatten().tolist())


def accepts(compiled, tokenizer, text: str, stop: int = STOPS[0]) -> bool:
    matcher = compiled.matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.accept(stop) and matcher.is_terminated()


def test_mask_is_what_the_matcher_accepts_in_our_layout(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("regex", r"(yes|no)!?"))
    matcher = compiled.matcher()
    for step, token in enumerate([None, *tokenizer.encode("no")]):
        if token is not None:
            assert matcher.accept(token)
        bitmask = allocate_bitmask(2, tokenizer.vocab_size)
        matcher.fill_bitmask(bitmask, 1)
        mask = allowed(bitmask, 1, tokenizer.vocab_size)
        takes = set()
        for candidate in range(tokenizer.vocab_size):
            if matcher.accept(candidate):
                takes.add(candidate)
                matcher.rollback(1)
        assert mask == takes and mask, step
        assert allowed(bitmask, 0, tokenizer.vocab_size) == set(range(tokenizer.vocab_size))  # other rows untouched
    assert set(STOPS) <= mask  # after "no" the grammar may end: every stop token is allowed


def test_layout_agrees_with_llguidance_byte_mask(backend, tokenizer):
    """Bit j of word i is token 32*i + j: the same tokens llguidance's one-byte-per-token mask allows."""
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "integer"})))
    bitmask = allocate_bitmask(1, tokenizer.vocab_size)
    compiled.matcher().fill_bitmask(bitmask, 0)
    bias = compiled.template.deep_copy().compute_logit_bias()
    assert allowed(bitmask, 0, tokenizer.vocab_size) == {t for t in range(tokenizer.vocab_size) if bias[t]}


def test_stop_tokens_rejected_tokens_and_rollback(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("choices", json.dumps(["red", "green"])))
    matcher = compiled.matcher()
    assert not matcher.accept(STOPS[1])  # nothing chosen yet
    assert not matcher.accept(tokenizer.encode("blue")[0])  # refused, and the state is unchanged
    for token in tokenizer.encode("red"):
        assert matcher.accept(token)
    assert matcher.accept(STOPS[1]) and matcher.is_terminated()  # any of the model's stop tokens ends it
    assert not matcher.accept(tokenizer.encode("x")[0])
    matcher.rollback(1)  # the stop token counts as one
    assert not matcher.is_terminated()
    matcher.rollback(len(tokenizer.encode("red")))
    assert all(matcher.accept(t) for t in tokenizer.encode("green")) and matcher.accept(STOPS[0])


def test_jump_forward_returns_whole_characters(backend, tokenizer):
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert backend.compile(GrammarSpec("json_schema", json.dumps(person))).matcher().jump_forward() == '{"name": "'
    # "é" and "ê" share their first UTF-8 byte: a forced half character is not returned.
    assert backend.compile(GrammarSpec("choices", json.dumps(["éa", "êb"]))).matcher().jump_forward() == ""
    assert backend.compile(GrammarSpec("choices", json.dumps(["éa", "éb"]))).matcher().jump_forward() == "é"


def test_json_schema_is_exact_or_names_what_it_approximates(backend, tokenizer):
    exact = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 3}}, "required": ["n"]})))
    assert exact.fidelity.exact and exact.fidelity.backend == "llguidance"
    assert accepts(exact, tokenizer, '{"n": 4}') and accepts(exact, tokenizer, '{"n": 4, "extra": true}')
    assert not accepts(exact, tokenizer, '{"n": 2}')
    unique = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
    assert not unique.fidelity.exact and "uniqueItems" in unique.fidelity.describe()
    assert accepts(unique, tokenizer, "[1, 1]")  # the approximation is real: it is not enforced
    one_of = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}
    assert "oneOf" in backend.compile(GrammarSpec("json_schema", json.dumps(one_of))).fidelity.describe()
    assert backend.compile(GrammarSpec("json_schema", "$$ANY$$")).fidelity.exact


def test_unanchored_patterns_are_searched(backend, tokenizer):
    """JSON Schema's pattern matches anywhere in the string; llguidance gets that right."""
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "b+"})))
    assert compiled.fidelity.exact
    assert accepts(compiled, tokenizer, '"abbc"') and not accepts(compiled, tokenizer, '"ac"')


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("json_schema", json.dumps({"type": "object", "properties": 5}), "json_schema.*properties must be an object"),
    ("json_schema", "true", "json_schema"),
    ("regex", "(unclosed", "regex.*unclosed group"),
    ("regex", "a(?=b)", "regex.*look-around"),
    ("ebnf", "root ::= missing", "ebnf.*'missing' is used but never defined"),
    ("ebnf", 'root ::= "a" (= "b")', "ebnf.*lookahead"),
    ("ebnf", 'item ::= "a"', "ebnf.*no `root` rule"),
])
def test_bad_specs_are_clear_errors(backend, kind, spec, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(GrammarSpec(kind, spec))


EBNF_GRAMMARS = [
    # llguidance's own GBNF converter makes `a` and `b` greedy lexemes, which rejects "abc"; ours keeps the language.
    ('root ::= a b\na ::= [a-z]+\nb ::= [a-z]', "abz"),
    ('root ::= ("a" | "ab") "bc"', "abc"),
    ('root ::= x "c"\nx ::= [a-c]*', "abc"),
    ('# a comment\nroot ::= item ("," item)*  # another\nitem ::= [a-z]{1,2}', "ab,"),
    ('root ::= "x"{2,3} [0-9]{1,} | "" | "\\u00e9\\x41\\"" [^"\\\\\\n]', 'x1"é\\'),
    ('root ::= "(" root ")" root | ""', "()"),
    ('root ::= [\\-a] [\\]x]? "@r0_root@"?', "-a]x@"),
]


@pytest.mark.parametrize(("ebnf", "alphabet"), EBNF_GRAMMARS)
def test_ebnf_language_equals_xgrammars(backend, xgrammar, tokenizer, ebnf, alphabet):
    """Every string up to five characters over the grammar's alphabet: accepted by both backends or by neither."""
    ours = backend.compile(GrammarSpec("ebnf", ebnf))
    reference = xgrammar.compile(GrammarSpec("ebnf", ebnf))
    assert ours.fidelity.exact
    strings = ["".join(chars) for size in range(6) for chars in itertools.product(alphabet, repeat=size)]
    verdicts = [(text, accepts(ours, tokenizer, text), accepts(reference, tokenizer, text)) for text in strings]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert any(v[1] for v in verdicts)


def test_ebnf_escapes_and_names(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("ebnf", 'root ::= "\\u00e9\\x41" tail\ntail ::= "@r0_root@" | "\\t"'))
    assert accepts(compiled, tokenizer, "éA@r0_root@") and accepts(compiled, tokenizer, "éA\t")
    assert not accepts(compiled, tokenizer, "éA")
    # One lexeme per character: no multi-character string or class reaches llguidance's greedy lexer.
    lark = ebnf_to_lark('root ::= "ab" [a-z]+')
    assert '"a" "b"' in lark
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark)) == ""
