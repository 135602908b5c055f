"""xgrammar: JSON schema, regex, EBNF, choices and any-JSON, compiled against the model's tokenizer."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from .spec import ANY_JSON, GrammarSpec

# xgrammar (through 0.2.9, its issue #800) lowers a string with minLength/maxLength to a repetition of this class,
# which admits raw control characters: JSON forbids them, and json.loads rejects such output. We exclude them.
# Escapes stay out as upstream has them: a class with an escape alternative loses xgrammar's fast path for bounded
# repetition (one mask fill took 1.8 s on a jsonschemabench schema).
LENGTH_BOUNDED_CHAR = r'(([^\"\\\r\n]))'
JSON_UNESCAPED_CHAR = r'(([^\0-\x1f\"\\]))'


def json_schema_grammar(schema: str) -> xgr.Grammar | str:
    """The schema's grammar, as EBNF text with length-bounded strings kept to JSON characters when it has any."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    return text.replace(LENGTH_BOUNDED_CHAR, JSON_UNESCAPED_CHAR) if LENGTH_BOUNDED_CHAR in text else grammar


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
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is off: ours (bounded, keyed by spec) is the one place compiled grammars live.
        self._compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        try:
            return XGrammarCompiled(self._compile(spec))
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as error:
            raise ValueError(f"{spec.kind} does not compile: {error}") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            if spec.spec == ANY_JSON:
                return self._compiler.compile_builtin_json_grammar()
            return self._compiler.compile_grammar(json_schema_grammar(spec.spec))
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.spec)
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.spec)
        if spec.kind == "choices":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.spec))
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        raise ValueError(f"xgrammar does not support grammar kind {spec.kind!r}")
