"""xgrammar's matcher against every instance of ../shared/data/jsonschemabench-dev: valid instances accepted,
invalid ones rejected, except for the schemas recorded by name as known gaps (features xgrammar does not
enforce, or key orders other than the schema's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from furcate.grammars.base import GrammarSpec
from furcate.grammars.cache import make_backend

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev"
KNOWN_GAPS = Path(__file__).parent / "data" / "xgrammar_known_gaps.json"
EOS = 2


def accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text) + [EOS]) and matcher.is_terminated()


def serializations(data) -> list[str]:
    """The grammar allows no free whitespace: try both usual separator styles, with and without ASCII escapes."""
    return [json.dumps(data, separators=separators, ensure_ascii=ascii_only)
            for separators in ((", ", ": "), (",", ":")) for ascii_only in (True, False)]


def mismatched_schemas(tokenizer) -> tuple[set[str], set[str]]:
    """(schemas that do not compile, schemas with an instance judged against its `valid` flag)."""
    backend = make_backend("xgrammar", tokenizer, tokenizer.vocab_size, [EOS], compile_timeout_s=30)
    failed, mismatched = set(), set()
    for path in sorted(BENCH.glob("*.json")):
        case = json.loads(path.read_text())
        try:
            compiled = backend.compile(GrammarSpec("json_schema", json.dumps(case["schema"])))
        except ValueError:
            failed.add(path.name)
            continue
        for test in case["tests"]:
            accepted = any(accepts(compiled, tokenizer, text) for text in serializations(test["data"]))
            if accepted != test["valid"]:
                mismatched.add(path.name)
    return failed, mismatched


@pytest.mark.skipif(not BENCH.is_dir(), reason="the shared jsonschemabench-dev data set is not present")
def test_matcher_agrees_with_every_instance_outside_known_gaps(tokenizer):
    failed, mismatched = mismatched_schemas(tokenizer)
    gaps = json.loads(KNOWN_GAPS.read_text())
    assert failed <= set(gaps["does_not_compile"]), sorted(failed - set(gaps["does_not_compile"]))
    assert mismatched <= set(gaps["mismatch"]), sorted(mismatched - set(gaps["mismatch"]))
