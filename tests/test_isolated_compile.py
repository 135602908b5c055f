"""outlines-core compiles in a child process: the Index comes back, and a compile past its time or memory limit
fails alone with a clear error."""

from __future__ import annotations

import pytest
from outlines_core import Guide, Vocabulary

from furcate.grammars.isolated import CompileLimitExceeded, build_index_isolated

VOCABULARY = Vocabulary(3, {b"a": [0], b"b": [1], b"ab": [2]})
# Its DFA needs 2**k states: the classic exponential blow-up.
EXPLODING = "(a|b)*a(a|b){22}"


def test_index_comes_back_and_works():
    index = build_index_isolated("regex", "(ab)+", VOCABULARY, timeout_s=30, memory_limit_bytes=1 << 30)
    guide = Guide(index)
    assert guide.accepts_tokens([0, 1, 2])
    assert not guide.accepts_tokens([1])


def test_time_limit_stops_the_compile():
    with pytest.raises(CompileLimitExceeded, match="within 0.5s"):
        build_index_isolated("regex", EXPLODING, VOCABULARY, timeout_s=0.5, memory_limit_bytes=8 << 30)


def test_memory_limit_stops_the_compile():
    with pytest.raises(CompileLimitExceeded, match="memory"):
        build_index_isolated("regex", EXPLODING, VOCABULARY, timeout_s=120, memory_limit_bytes=32 << 20)


def test_a_rejected_regex_is_named():
    with pytest.raises(ValueError, match="Error"):
        build_index_isolated("regex", "(unclosed", VOCABULARY, timeout_s=30, memory_limit_bytes=1 << 30)


def test_a_schema_becomes_its_index_in_the_child():
    vocabulary = Vocabulary(9, {bytes([c]): [c] for c in b'{}":0123456789abcdefghijklmnopqrstuvwxyz'})
    index = build_index_isolated("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, '
                                 '"required": ["n"]}', vocabulary, timeout_s=30, memory_limit_bytes=1 << 30)
    assert Guide(index).accepts_tokens(list(b'{"n":42}'))
