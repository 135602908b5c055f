"""Sampling parameters of one request, validated where the request enters the engine."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ...grammars.spec import KINDS, GrammarSpec

# The largest float32: sampling parameters beyond it overflow the sampler's tensors.
FLOAT32_MAX = 3.4028234663852886e38
# Below this temperature sampling is argmax, as in SGLang.
GREEDY_TEMPERATURE = 1e-5
MAX_NEW_TOKENS_DEFAULT = 128
# More samples of one prompt than this is a mistake or an attack (each is a request object and a KV share).
MAX_N = 1024
# Longest lists a request may carry: enough for any real use, small enough that no request allocates unbounded.
MAX_STOPS = 64
MAX_STOP_TOKEN_IDS = 1024
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
               "allow_approximate_schema")


@dataclass
class SamplingParams:
    max_new_tokens: int = MAX_NEW_TOKENS_DEFAULT
    min_new_tokens: int = 0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Regular expressions searched in the output text; the first match ends generation like a stop string.
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    # The request's constraint, which from_dict builds from at most one of json_schema, regex, ebnf and choices:
    # those are request fields only, never kept (a pydantic schema class would not survive the trip to the scheduler).
    grammar: GrammarSpec | None = None
    # Under grammar_backend="auto", serve a constraint that no backend enforces exactly with the closest
    # approximation instead of failing the request.
    allow_approximate_schema: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; an unknown field or bad value raises ValueError naming the field."""
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(raw).__name__}")
        raw = dict(raw or {})
        # grammar is built from the request's KINDS fields, except that an in-process caller (the interpreter, whose gen
        # built and normalized the spec once) may hand over the GrammarSpec itself; no wire format can carry one.
        built = raw.pop("grammar") if isinstance(raw.get("grammar"), GrammarSpec) else None
        constraints = {kind: value for kind in KINDS if (value := raw.pop(kind, None)) is not None}
        known = {f.name for f in dataclasses.fields(cls)} - {"grammar"}
        unknown = sorted(str(key) for key in set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if raw.get("max_new_tokens", 0) is None:
            raw.pop("max_new_tokens")
        for name in ("stop", "stop_regex"):
            if isinstance(raw.get(name), str):
                raw[name] = [raw[name]]
            if raw.get(name) is None:
                raw.pop(name, None)
        if raw.get("stop_token_ids") is None:
            raw.pop("stop_token_ids", None)
        if raw.get("logit_bias") is not None:
            raw["logit_bias"] = _parse_logit_bias(raw["logit_bias"])
        else:
            raw.pop("logit_bias", None)
        params = cls(**raw, grammar=_grammar(constraints, built))
        params.validate()
        return params

    def validate(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_int("min_new_tokens", self.min_new_tokens, low=0)
        _check_int("n", self.n, low=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        # Below 0.01 the penalty divides logits into overflow, so such values are refused rather than obeyed.
        _check_float("repetition_penalty", self.repetition_penalty, low=0.01, high=2.0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_regex, list) or not all(isinstance(s, str) and s for s in self.stop_regex):
            raise ValueError(f"stop_regex must be a non-empty string or a list of them, got {self.stop_regex!r}")
        for name, texts in (("stop", self.stop), ("stop_regex", self.stop_regex)):
            if not all(_valid_text(text) for text in texts):
                raise ValueError(f"{name} holds a lone surrogate, which decoded text never contains")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name, values, limit in (("stop", self.stop, MAX_STOPS), ("stop_regex", self.stop_regex, MAX_STOPS),
                                    ("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)):
            if len(values) > limit:
                raise ValueError(f"{name} may hold at most {limit} entries, got {len(values)}")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"stop_regex {pattern!r} does not compile: {error}") from None
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, low=0)

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def declared_default(name: str) -> Any:
    """The default SamplingParams declares for field `name` (None for a list or dict field: empty, nothing to send).
    The one place sampling defaults live: run() and the CLI read theirs from here."""
    default = SamplingParams.__dataclass_fields__[name].default
    return None if default is dataclasses.MISSING else default


def _grammar(constraints: dict[str, Any], built: GrammarSpec | None) -> GrammarSpec | None:
    """The request's one constraint: the spec handed over already built, or built here from its field."""
    if built is None:
        return GrammarSpec.from_params(**constraints)
    if constraints:
        raise ValueError(f"give at most one of a built grammar, json_schema, regex, ebnf, choices; got "
                         f"{list(constraints)}")
    return built


def _parse_logit_bias(raw: Any) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(raw).__name__}")
    parsed: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
            bias = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entries must be token id -> number, got {key!r}: {value!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        if not _finite(bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {key!r}: {value!r}")
        parsed[token] = bias
    return parsed


def _check_int(name: str, value: Any, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_float(name: str, value: Any, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ValueError(f"{name} must be a finite number within float32's range, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _finite(value: int | float) -> bool:
    """Finite as the sampler's float32 tensors hold it (1e300 is inf there, and a temperature of inf makes the
    logits NaN under a grammar's mask)."""
    try:
        return math.isfinite(float(value)) and abs(float(value)) <= FLOAT32_MAX
    except OverflowError:  # an int too large for a float
        return False


def _valid_text(text: str) -> bool:
    """Whether text encodes as UTF-8 (a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
