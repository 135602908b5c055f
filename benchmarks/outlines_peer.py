"""The peer we compare structured generation against: outlines 1.x on the same weights, run as its users run it.

One `transformers` model wrapped by `outlines.from_transformers`; per schema an `outlines.Generator` over
`outlines.types.JsonSchema` (outlines-core backend, the default for JSON schemas), then one greedy request at a
time through Hugging Face `generate`. Nothing is batched or cached across schemas, because outlines does neither.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import outlines
import torch
from outlines.types import JsonSchema
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.utils import logging as hf_logging


@dataclass
class PeerResult:
    """One schema's outcome through outlines, in the units the furcate side reports."""

    text: str | None  # None when the schema failed to compile or generate
    output_tokens: int  # generated token ids, EOS included when the model emitted it
    compile_seconds: float  # building the Generator, i.e. outlines-core's regex and token index for the schema
    generate_seconds: float  # wall time of `generate` alone
    error: str | None  # "<ExceptionType>: message", at most 300 characters


class _TokenCounter(StoppingCriteria):
    """Counts generated tokens without ever stopping.

    outlines returns only decoded text (special tokens skipped), so re-tokenizing it would miss EOS and could
    merge tokens differently. Hugging Face calls every stopping criterion once per generated token, which gives
    the exact `len(generated ids)` at the cost of one tiny call per step.
    """

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        self.count += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """Hide transformers' "Loading weights" bar, which would land in the benchmark's output, then restore it."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def run_outlines(
    model_dir: str, prompts: list[str], schemas: list[dict], max_new_tokens: int, threads: int
) -> list[PeerResult]:
    """Generate `prompts[i]` under `schemas[i]` with outlines, sequentially; a failing schema only records its error.

    Prompts must already be chat-template-rendered strings. Generation is greedy (`do_sample=False`, which
    outlines forwards untouched to `model.generate`) and bounded by `max_new_tokens`.
    """
    if len(prompts) != len(schemas):
        raise ValueError(f"{len(prompts)} prompts for {len(schemas)} schemas")
    torch.set_num_threads(threads)
    with _quiet_loading():
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = outlines.from_transformers(hf_model, AutoTokenizer.from_pretrained(model_dir))
    # outlines wraps any str prompt in the tokenizer's chat template when it has one; ours are rendered already.
    model.type_adapter.has_chat_template = False

    results = []
    for prompt, schema in zip(prompts, schemas):
        started = time.perf_counter()
        try:
            generator = outlines.Generator(model, JsonSchema(json.dumps(schema)))
        except Exception as exc:  # noqa: BLE001 - a schema outlines cannot compile is a data point, not a crash
            results.append(PeerResult(None, 0, time.perf_counter() - started, 0.0, _error(exc)))
            continue
        compile_seconds = time.perf_counter() - started
        counter = _TokenCounter()
        started = time.perf_counter()
        try:
            text = generator(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([counter]))
        except Exception as exc:  # noqa: BLE001 - a failed generation is recorded against the peer, not raised
            results.append(PeerResult(None, counter.count, compile_seconds, time.perf_counter() - started,
                                      _error(exc)))
            continue
        results.append(PeerResult(text, counter.count, compile_seconds, time.perf_counter() - started, None))
    return results
