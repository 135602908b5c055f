"""Structured output validated as a last line: every finished json_schema output carries a verdict in meta_info
(valid, violating with jsonschema's message and path, cut short, or not checkable), and the engine counts them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import requests

from conftest import EXACT, TINY_POOL_TOKENS, assert_pool_free
from furcate import Engine
from furcate.grammars.spec import ANY_JSON
from furcate.runtime.engine.request_state import cut_by
from furcate.runtime.engine.schema_check import SchemaChecker
from furcate.runtime.wire.finish_reason import FinishReason

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}
# xgrammar does not enforce uniqueItems, and the grammar allows exactly one output: ["a", "a"], which violates it.
FORCED_DUPLICATES = {"type": "array", "items": {"enum": ["a"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
# xgrammar compiles this pattern; Python's re (so jsonschema) does not know the (?<name>...) group syntax.
NAMED_GROUP = {"type": "string", "pattern": "^(?<x>a)$"}
GREEDY = {"temperature": 0.0}


def check(schema: dict | str, text: str, cut: str | None = None, checker: SchemaChecker | None = None):
    schema_text = schema if isinstance(schema, str) else json.dumps(schema)
    return (checker or SchemaChecker()).check(schema_text, text, cut)


def test_valid_and_violating_outputs_get_jsonschemas_message_and_path():
    assert check(PERSON, '{"name": "Ann", "age": 3}').meta() == {"schema_valid": True}
    verdict = check(PERSON, '{"name": "Ann", "age": -1}')
    assert verdict.valid is False
    assert verdict.reason.startswith("violates the schema: ") and "minimum" in verdict.reason
    assert "$.age" in verdict.reason
    assert verdict.meta() == {"schema_valid": False, "schema_violation": verdict.reason}
    missing = check(PERSON, '{"name": "Ann"}')
    assert missing.valid is False and "'age' is a required property" in missing.reason


def test_cut_outputs_are_incomplete_not_violations():
    checker = SchemaChecker()
    length = check(PERSON, '{"name": "An', "length", checker)
    assert length.valid is False and length.reason.startswith("incomplete (length): ")
    stopped = check(PERSON, '{"name": "Ann"', "stop string", checker)
    assert stopped.valid is False and stopped.reason.startswith("incomplete (stop string): ")
    complete_garbage = check(PERSON, '{"name": ', None, checker)
    assert complete_garbage.valid is False and complete_garbage.reason.startswith("not JSON: ")
    # A cut output that happens to be valid is reported valid: it is what the caller gets.
    assert check({"type": "integer"}, "12", "length", checker).valid is True
    assert checker.stats() == {"schema_checked": 4, "schema_violations": 1, "schema_incomplete": 2,
                               "schema_unchecked": 0}


def test_any_json_needs_only_to_parse():
    assert check(ANY_JSON, '[1, {"a": null}]').valid is True
    assert check(ANY_JSON, "[1,").valid is False


def test_the_schemas_own_draft_decides():
    # Draft 4's boolean exclusiveMaximum: 5 is out. Under the default draft (2020-12) this schema is not even valid.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "maximum": 5,
              "exclusiveMaximum": True}
    assert check(draft4, "5").valid is False and check(draft4, "4.5").valid is True
    # Draft 2020-12's prefixItems, unknown to draft 7 (which ignores it).
    pair = {"type": "array", "prefixItems": [{"type": "integer"}]}
    assert check(pair, '["x"]').valid is False
    assert check({**pair, "$schema": "http://json-schema.org/draft-07/schema#"}, '["x"]').valid is True


def test_formats_are_checked():
    assert check({"type": "string", "format": "ipv4"}, '"10.0.0.1"').valid is True
    assert check({"type": "string", "format": "ipv4"}, '"999.0.0.1"').valid is False
    verdict = check({"type": "string", "format": "email"}, '"nobody"')
    assert verdict.valid is False and "email" in verdict.reason


def test_a_schema_jsonschema_cannot_handle_is_reported_unchecked():
    checker = SchemaChecker()
    verdict = check(NAMED_GROUP, '"a"', None, checker)
    assert verdict.valid is None and "jsonschema cannot check this schema" in verdict.reason
    assert verdict.meta() == {"schema_valid": None, "schema_unchecked_reason": verdict.reason}
    assert checker.stats()["schema_unchecked"] == 1 and checker.stats()["schema_checked"] == 0


class CountingHandler(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        CountingHandler.hits += 1
        body = json.dumps({"type": "integer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_remote_refs_are_never_fetched():
    server = HTTPServer(("127.0.0.1", 0), CountingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        schema = {"$ref": f"http://127.0.0.1:{server.server_port}/integer.json"}
        verdict = check(schema, '"not an integer"')
    finally:
        server.shutdown()
    assert CountingHandler.hits == 0
    assert verdict.valid is None and "Unresolvable" in verdict.reason


def test_validators_are_compiled_once_and_the_cache_is_bounded():
    checker = SchemaChecker(max_cached=2)
    schemas = [json.dumps({"type": "integer", "maximum": m}) for m in range(3)]
    first = checker._validator(schemas[0])
    assert checker._validator(schemas[0]) is first
    checker._validator(schemas[1])
    checker._validator(schemas[0])  # used again: the least recently used is now schemas[1]
    checker._validator(schemas[2])
    assert list(checker._validators) == [schemas[0], schemas[2]]
    assert checker._validator(schemas[0]) is first


def test_only_the_grammars_own_end_counts_as_complete():
    assert cut_by(FinishReason.stop_token(2), stop_token_ids=[]) is None
    assert cut_by(FinishReason.stop_token(11), stop_token_ids=[11]) == "stop token"
    assert cut_by(FinishReason.stop_string("}"), stop_token_ids=[]) == "stop string"
    assert cut_by(FinishReason.length(4), stop_token_ids=[]) == "length"


# -- through the engine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar_engine(tiny_model_dirs):
    """xgrammar named explicitly: it serves schemas it only approximates (uniqueItems), which "auto" refuses."""
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, max_total_tokens=TINY_POOL_TOKENS, torch_num_threads=2,
                grammar_backend="xgrammar") as engine:
        yield engine


@pytest.fixture
def engine(xgrammar_engine):
    yield xgrammar_engine
    assert_pool_free(xgrammar_engine)


def test_engine_reports_a_verdict_on_every_finished_schema_output(engine):
    before = engine.get_stats()
    duplicates, person_cut, unchecked, plain = engine.generate(["a", "b", "c", "d"], [
        {**GREEDY, "json_schema": FORCED_DUPLICATES, "max_new_tokens": 32},
        {**GREEDY, "json_schema": PERSON, "max_new_tokens": 3},
        {**GREEDY, "json_schema": NAMED_GROUP, "max_new_tokens": 8},
        {**GREEDY, "max_new_tokens": 3},
    ])
    assert duplicates["text"] == '["a", "a"]' and duplicates["meta_info"]["finish_reason"]["type"] == "stop"
    meta = duplicates["meta_info"]
    assert meta["schema_valid"] is False
    assert meta["schema_violation"].startswith("violates the schema: ") and "non-unique" in meta["schema_violation"]
    assert person_cut["meta_info"]["finish_reason"]["type"] == "length"
    assert person_cut["meta_info"]["schema_valid"] is False
    assert person_cut["meta_info"]["schema_violation"].startswith("incomplete (length): ")
    assert unchecked["meta_info"]["schema_valid"] is None
    assert "schema_valid" not in plain["meta_info"]
    stats = engine.get_stats()
    assert stats["schema_violations"] == before["schema_violations"] + 1
    assert stats["schema_incomplete"] == before["schema_incomplete"] + 1
    assert stats["schema_unchecked"] == before["schema_unchecked"] + 1


def test_valid_output_and_stream_carry_the_verdict(engine):
    params = {**GREEDY, "json_schema": {"type": "boolean"}, "max_new_tokens": 8}
    result = engine.generate("true or false?", params)
    assert result["text"] in ("true", "false") and result["meta_info"]["schema_valid"] is True
    chunks = list(engine.generate("true or false?", params, stream=True))
    assert all("schema_valid" not in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["schema_valid"] is True


def test_stop_string_cut_and_special_tokens_shown(engine):
    cut = engine.generate("x", {**GREEDY, "json_schema": FORCED_DUPLICATES, "stop": [","], "max_new_tokens": 32})
    assert cut["text"] == '["a"' and cut["meta_info"]["schema_violation"].startswith("incomplete (stop string)")
    # The stop token that ends the grammar is shown in the text, but it is not part of the JSON.
    shown = engine.generate("x", {**GREEDY, "json_schema": {"type": "boolean"}, "skip_special_tokens": False,
                                  "max_new_tokens": 8})
    stop_text = engine.tokenizer.decode(shown["output_ids"][-1:])
    assert shown["text"].endswith(stop_text) and shown["text"].removesuffix(stop_text) in ("true", "false")
    assert shown["meta_info"]["schema_valid"] is True


def test_native_server_passes_the_verdict_through(tiny_server):
    body = {"text": "x", "sampling_params": {**GREEDY, "json_schema": PERSON, "max_new_tokens": 3}}
    meta = requests.post(f"{tiny_server.url}/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["schema_valid"] is False and meta["schema_violation"].startswith("incomplete (length): ")
