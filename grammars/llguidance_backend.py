"""llguidance: JSON schema, regex, EBNF (translated to Lark) and choices, over the model's tokenizer.

llguidance builds its lexer and parser when a matcher is constructed and computes masks lazily, so "compiling" here
is constructing one matcher; each request gets a copy of it. Its construction is bounded by llguidance's own parser
limits (lexer fuel, grammar size, lexer states), so it runs on the compile pool like xgrammar, not in a child process.

Its JSON compiler either enforces a schema exactly or refuses it, naming the keyword ("Unimplemented keys:
[\"not\"]", "oneOf constraints are not supported"); the refused ones are compiled again leniently (keywords
ignored, oneOf as anyOf) and its warnings become the grammar's approximations. Its formats are tried on strings they
forbid (formats.py); date and date-time, which it gets wrong on February 29, reach it as exact patterns instead.

Its packed mask layout is ours: int32 words, bit j of word i for token 32*i + j (llguidance.torch writes it).
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Callable

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from .base import Compiled, Fidelity
from .ebnf_to_lark import ebnf_to_lark
from .formats import format_departures
from .regex_dialect import with_ascii_classes
from .rewrites import equivalent_schema
from .spec import ANY_JSON, GrammarSpec

# The same serialization as the xgrammar backend (no free whitespace; `, ` and `: `), and llguidance's strict mode:
# an unsupported keyword is an error, never silently dropped. A schema's own "x-guidance" may change the whitespace
# but not the strictness (overrides win over it).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
STRICT = {"lenient": False, "coerce_one_of": False}
LENIENT = {"lenient": True}


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_id
        self._stops = stop_token_ids
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._allows(bitmask, row, self._eos):  # llguidance knows one stop token; the model may have more
            for token in self._stops:
                self._allow(bitmask, row, token)

    @staticmethod
    def _allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    @staticmethod
    def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
        word = int(bitmask[row, token // 32]) | (1 << (token % 32))
        bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32

    def accept(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._stops:
            return self._accept_stop()
        # try_consume_tokens leaves the state unchanged on a rejected token; consume_token would poison it.
        return self._matcher.try_consume_tokens([token]) == 1

    def _accept_stop(self) -> bool:
        # Once the grammar cannot be extended (stop reason NoExtension) llguidance validates the stop token as 0,
        # though its mask allows it. It is not consumed: llguidance counts a stop token for rollback in some states
        # and not in others, so the matcher keeps that one token to itself, as the outlines matcher does.
        if self._matcher.stop_reason() != "NoExtension" and self._matcher.validate_tokens([self._eos]) != 1:
            return False
        self._terminated = True
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def jump_forward(self) -> str:
        forced = self._matcher.compute_ff_bytes()
        if forced and 0x80 <= forced[0] < 0xC0:  # the rest of a character the last token began: the model's part
            return ""
        # The forced bytes may end inside a UTF-8 character: keep the complete characters only.
        return codecs.getincrementaldecoder("utf-8")().decode(forced)


class LLGuidanceCompiled:
    def __init__(self, template: llguidance.LLMatcher, fidelity: Fidelity, eos_token_id: int,
                 stop_token_ids: frozenset[int]) -> None:
        self.template = template
        self.fidelity = fidelity
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.eos_token_id, self.stop_token_ids)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.eos_token_id = stop_token_ids[0]
        self.stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_id)
        self._format_testers: dict[str, Callable[[str], bool] | None] = {}

    def compile(self, spec: GrammarSpec) -> LLGuidanceCompiled:
        if spec.kind == "json_schema":
            schema = equivalent_schema(json.loads("{}" if spec.spec == ANY_JSON else spec.spec))
            template = self._json_schema(json.dumps(schema))
            departures = format_departures(schema, self._format_tester)
        elif spec.kind == "regex":  # llguidance's \d and \w are Unicode classes
            regex, departures = with_ascii_classes(spec.spec)
            template = self._build(spec.kind, llguidance.LLMatcher.grammar_from_regex(regex))
        else:
            template, departures = self._build(spec.kind, self._grammar(spec)), []
        warnings = list(dict.fromkeys(template.get_grammar_warnings()))
        fidelity = Fidelity(self.name, tuple(warnings + departures))
        return LLGuidanceCompiled(template, fidelity, self.eos_token_id, self.stop_token_ids)

    def plan(self, spec: GrammarSpec) -> Compiled:
        # Building the matcher is the whole compile, and it is quick (~1 ms).
        return Compiled(self.compile(spec))

    def _json_schema(self, schema: str) -> llguidance.LLMatcher:
        """The strict build when llguidance enforces the schema exactly, else the lenient one, whose warnings name
        what it ignores. ValueError (with the strict build's reason) when neither builds."""
        try:
            strict_grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS, STRICT)
            lenient_grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS, LENIENT)
        except ValueError as error:  # e.g. a boolean schema: llguidance takes objects only
            raise ValueError(f"json_schema does not compile with llguidance: {error}") from None
        strict = self._matcher(strict_grammar)
        if not strict.is_error():
            return strict
        lenient = self._matcher(lenient_grammar)
        if lenient.is_error():
            raise ValueError(f"json_schema does not compile with llguidance: {error_summary(strict.get_error())}")
        return lenient

    def _format_tester(self, fmt: str) -> Callable[[str], bool] | None:
        """Whether llguidance's grammar for the format takes a string; None where llguidance does not implement the
        format. Built once per format."""
        if fmt not in self._format_testers:
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": fmt}, JSON_DEFAULTS,
                                                                    STRICT)
            matcher = self._matcher(grammar)
            self._format_testers[fmt] = None if matcher.is_error() else functools.partial(self._takes, matcher)
        return self._format_testers[fmt]

    def _takes(self, template: llguidance.LLMatcher, text: str) -> bool:
        matcher = LLGuidanceMatcher(template.deep_copy(), self.eos_token_id, self.stop_token_ids)
        tokens = self._tokenizer.tokenize_str(json.dumps(text))
        return all(matcher.accept(token) for token in tokens) and matcher.accept(self.eos_token_id)

    def _grammar(self, spec: GrammarSpec) -> str:
        if spec.kind == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(ebnf_to_lark(spec.spec))
            except ValueError as error:
                raise ValueError(f"ebnf does not compile with llguidance: {error}") from None
        if spec.kind == "choices":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.spec))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        raise ValueError(f"llguidance does not support grammar kind {spec.kind!r}")

    def _build(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        matcher = self._matcher(grammar)
        if matcher.is_error():
            raise ValueError(f"{kind} does not compile with llguidance: {error_summary(matcher.get_error())}")
        return matcher

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)


def error_summary(error: str) -> str:
    """llguidance's errors go on over many lines (the regex with a caret under it, the grammar around it): keep the
    first line and the line that names the problem."""
    lines = error.strip().splitlines() or ["unknown error"]
    reasons = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + reasons[:1])
