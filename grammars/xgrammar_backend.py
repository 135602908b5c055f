"""xgrammar: JSON schema, regex, EBNF, choices and any-JSON, compiled against the model's tokenizer.

xgrammar reports some approximations only as warnings its C++ code prints on stderr (oneOf treated as anyOf, allOf
with several branches, minLength ignored beside a pattern, regex anchors or lookaheads ignored), and ignores other
keywords silently (uniqueItems, if/then/else, dependentRequired, ...). Both end up in the compiled grammar's
Fidelity: the warnings read from stderr while the spec converts, the silent ones found by converting the schema
once without each keyword (schema_keywords.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

import torch
import xgrammar as xgr

from .base import Fidelity
from .formats import format_departures, with_exact_dates
from .rewrites import equivalent_schema
from .schema_keywords import UNKNOWN_FORMAT, ignored_keywords, regex_features, unanchored_patterns
from .spec import ANY_JSON, GrammarSpec

# xgrammar (through 0.2.9, its issue #800) lowers a string with minLength/maxLength to a repetition of this class,
# which admits raw control characters: JSON forbids them, and json.loads rejects such output. We exclude them.
# Escapes stay out as upstream has them: a class with an escape alternative loses xgrammar's fast path for bounded
# repetition (one mask fill took 1.8 s on a jsonschemabench schema).
LENGTH_BOUNDED_CHAR = r'(([^\"\\\r\n]))'
JSON_UNESCAPED_CHAR = r'(([^\0-\x1f\"\\]))'
# No free whitespace (`, ` and `: ` as json.dumps writes them), and strict_mode off: xgrammar's default strict mode
# forbids properties and items the schema does not list, which JSON Schema allows unless it says otherwise.
JSON_OPTIONS = {"any_whitespace": False, "strict_mode": False}
# File descriptor 2 belongs to the whole process: one capture at a time.
_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def native_warnings() -> Iterator[list[str]]:
    """The warnings xgrammar's C++ code prints inside the block (their text after "Warning: "), deduplicated.
    Lines other threads print meanwhile are passed on to the real stderr afterwards."""
    warnings: list[str] = []
    with _STDERR_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield warnings
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                if "Warning: " in line:
                    warnings.append(line.split("Warning: ", 1)[1])
                else:
                    print(line, file=sys.stderr)
    warnings[:] = list(dict.fromkeys(warnings))


def json_schema_grammar(schema: str) -> xgr.Grammar | str:
    """The schema's grammar, as EBNF text with length-bounded strings kept to JSON characters when it has any."""
    grammar = xgr.Grammar.from_json_schema(schema, **JSON_OPTIONS)
    text = str(grammar)
    return text.replace(LENGTH_BOUNDED_CHAR, JSON_UNESCAPED_CHAR) if LENGTH_BOUNDED_CHAR in text else grammar


def schema_text(schema: str) -> str:
    return str(xgr.Grammar.from_json_schema(schema, **JSON_OPTIONS))


def regex_departures(regex: str) -> list[str]:
    """Where xgrammar's regex dialect differs from furcate's (regex_dialect.py; measured, and pinned by the tests):
    its `.` also matches a newline."""
    return ["'.': also matches a newline"] if "dot" in regex_features(regex) else []


def takes_string(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """The grammar accepts `text` as a JSON string and may end there."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(json.dumps(text)) and matcher.is_completed()


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def jump_forward(self) -> str:
        return self._matcher.find_jump_forward_string()


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar, fidelity: Fidelity) -> None:
        self.compiled = compiled
        self.fidelity = fidelity

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled)


class XGrammarPlan:
    def __init__(self, compiler: xgr.GrammarCompiler, kind: str, grammar: xgr.Grammar | str | None,
                 fidelity: Fidelity) -> None:
        self._compiler = compiler
        self._kind = kind
        self._grammar = grammar  # None: the built-in any-JSON grammar
        self.fidelity = fidelity

    def compile(self) -> XGrammarCompiled:
        try:
            compiled = (self._compiler.compile_builtin_json_grammar() if self._grammar is None
                        else self._compiler.compile_grammar(self._grammar))
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"{self._kind} does not compile: {error}") from None
        return XGrammarCompiled(compiled, self.fidelity)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is off: ours (bounded, keyed by spec) is the one place compiled grammars live.
        self._compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self._format_testers: dict[str, Callable[[str], bool] | None] = {}

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        return self.plan(spec).compile()

    def plan(self, spec: GrammarSpec) -> XGrammarPlan:
        """The converted grammar and its fidelity, before the compile against the vocabulary (the slow part)."""
        try:
            grammar, approximations = self._grammar(spec)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as error:
            raise ValueError(f"{spec.kind} does not compile: {error}") from None
        return XGrammarPlan(self._compiler, spec.kind, grammar, Fidelity(self.name, tuple(approximations)))

    def _format_tester(self, fmt: str) -> Callable[[str], bool] | None:
        """Whether xgrammar's grammar for the format takes a string; None where it ignores the format. Compiled
        once per format."""
        if fmt not in self._format_testers:
            schema = json.dumps({"type": "string", "format": fmt})
            ignored = schema_text(schema) == schema_text(json.dumps({"type": "string", "format": UNKNOWN_FORMAT}))
            compiled = None if ignored else self._compiler.compile_grammar(json_schema_grammar(schema))
            self._format_testers[fmt] = None if compiled is None else functools.partial(takes_string, compiled)
        return self._format_testers[fmt]

    def _grammar(self, spec: GrammarSpec) -> tuple[xgr.Grammar | str | None, list[str]]:
        """The grammar to compile (None: the built-in any-JSON one) and how it departs from the spec. Only the
        conversion runs while stderr is captured; the compile against the vocabulary, which may take seconds, not."""
        if spec.kind == "json_schema":
            if spec.spec == ANY_JSON:
                return None, []
            schema = equivalent_schema(json.loads(spec.spec))
            try:
                with native_warnings() as warnings:
                    grammar = json_schema_grammar(json.dumps(schema))
            except RuntimeError:  # xgrammar refuses a property whose schema is `false`, which the rewrites make
                schema = with_exact_dates(json.loads(spec.spec))
                with native_warnings() as warnings:
                    grammar = json_schema_grammar(json.dumps(schema))
            with native_warnings():  # the altered schemas' own warnings say nothing about this one
                ignored = ignored_keywords(schema, schema_text)
                formats = format_departures(schema, self._format_tester)
            return grammar, warnings + ignored + unanchored_patterns(schema) + formats
        if spec.kind == "regex":
            with native_warnings() as warnings:
                grammar = xgr.Grammar.from_regex(spec.spec)
            return grammar, warnings + regex_departures(spec.spec)
        if spec.kind == "ebnf":  # xgrammar's EBNF is the dialect furcate takes: exact by definition
            return spec.spec, []
        if spec.kind == "choices":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.spec))
            return f"root ::= {alternatives}", []
        raise ValueError(f"xgrammar does not support grammar kind {spec.kind!r}")
