"""Structured output checked as a last line: a json_schema request's finished text is validated with `jsonschema`
before it is returned, so a grammar backend's bug or an output cut short never passes on silently.

Runs on the engine's receiver thread, once per finished constrained request. Validators are compiled once per
schema text and kept in a small LRU. A schema jsonschema itself cannot check gives a verdict of None with the
reason; nothing here raises into the request or the thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import referencing
from jsonschema import exceptions, validators

from ...grammars.spec import ANY_JSON

MAX_CACHED_VALIDATORS = 64
# How a violation message starts, so a client can tell why an output is not valid: "incomplete (<why>)" for an
# output cut before its grammar finished (at max_new_tokens, by a stop string), else one of these.
NOT_JSON = "not JSON"
VIOLATES = "violates the schema"


@dataclass(frozen=True)
class SchemaVerdict:
    valid: bool | None  # None: the output could not be checked (see reason)
    reason: str | None = None

    def meta(self) -> dict[str, Any]:
        """The meta_info fields of this verdict."""
        if self.valid is None:
            return {"schema_valid": None, "schema_unchecked_reason": self.reason}
        if self.valid:
            return {"schema_valid": True}
        return {"schema_valid": False, "schema_violation": self.reason}


class SchemaChecker:
    """Validates finished json_schema outputs and counts the verdicts (merged into Engine.get_stats)."""

    def __init__(self, max_cached: int = MAX_CACHED_VALIDATORS) -> None:
        self.max_cached = max_cached
        # Schema text -> its validator, or why jsonschema cannot use the schema (cached too: checked once).
        self._validators: OrderedDict[str, Any] = OrderedDict()
        self.checked = 0
        self.violations = 0  # outputs the grammar finished that are still not valid: a grammar backend bug
        self.incomplete = 0  # outputs cut (max_new_tokens, the context, a stop string) before they were valid
        self.unchecked = 0

    def stats(self) -> dict[str, int]:
        return {"schema_checked": self.checked, "schema_violations": self.violations,
                "schema_incomplete": self.incomplete, "schema_unchecked": self.unchecked}

    def check(self, schema: str, text: str, cut: str | None) -> SchemaVerdict:
        """The verdict on `text`, the output of a request constrained to `schema` (JSON text or ANY_JSON); `cut`
        names what ended the output before its grammar did ("length", "stop string"), None if nothing did."""
        try:
            verdict = self._verdict(schema, text, cut)
        except Exception as error:  # noqa: BLE001 - a validator's own failure must not fail the request
            verdict = SchemaVerdict(None, f"jsonschema failed while checking: {type(error).__name__}: {error}")
        self._count(verdict, cut)
        return verdict

    def _verdict(self, schema: str, text: str, cut: str | None) -> SchemaVerdict:
        prefix = f"incomplete ({cut})" if cut else None
        try:
            instance = json.loads(text)
        except ValueError as error:
            return SchemaVerdict(False, f"{prefix or NOT_JSON}: {error}")
        if schema == ANY_JSON:
            return SchemaVerdict(True)
        validator = self._validator(schema)
        if isinstance(validator, str):
            return SchemaVerdict(None, validator)
        error = exceptions.best_match(validator.iter_errors(instance))
        if error is None:
            return SchemaVerdict(True)
        return SchemaVerdict(False, f"{prefix or VIOLATES}: {error.message} (at {error.json_path})")

    def _validator(self, schema: str) -> Any:
        """The compiled validator for `schema`, or a string saying why there is none."""
        if schema in self._validators:
            self._validators.move_to_end(schema)
            return self._validators[schema]
        validator = compile_validator(schema)
        self._validators[schema] = validator
        if len(self._validators) > self.max_cached:
            self._validators.popitem(last=False)
        return validator

    def _count(self, verdict: SchemaVerdict, cut: str | None) -> None:
        if verdict.valid is None:
            self.unchecked += 1
            return
        self.checked += 1
        if verdict.valid is False:
            if cut:
                self.incomplete += 1
            else:
                self.violations += 1


def compile_validator(schema: str) -> Any:
    """A validator of the schema's own draft with format checking on, or a string saying why there is none."""
    try:
        document = json.loads(schema)
        cls = validators.validator_for(document, default=validators.Draft202012Validator)
        cls.check_schema(document)
        # An empty registry: a schema's remote $ref is never fetched (jsonschema's default would download it).
        return cls(document, registry=referencing.Registry(), format_checker=cls.FORMAT_CHECKER)
    except Exception as error:  # noqa: BLE001 - whatever jsonschema cannot handle is reported, not raised
        return f"jsonschema cannot check this schema: {type(error).__name__}: {error}"
