"""STANDALONE's draft model, checked in the engine's process before the scheduler starts: a missing or unreadable
model, or one with another vocabulary than the target's, is a ValueError naming speculative_draft_model_path (in
the scheduler process it would only surface as a start-up failure)."""

from __future__ import annotations

import dataclasses
import glob
import os

from safetensors import safe_open

from ..config import EngineArgs
from ..model.weights.checkpoint import load_config, resolve_model_path
from ..model.weights.default_model import gguf_source


def prepare_draft_model(args: EngineArgs, target_path: str) -> EngineArgs:
    """args with the draft model's path resolved to a model directory (a GGUF converted as the target's is), once
    it is known to load: a supported config, readable safetensors headers, the target's vocabulary size."""
    path = args.speculative_draft_model_path
    if path is None:
        return args
    try:
        resolved = resolve_model_path(path)
        draft = load_config(resolved)
        read_headers(resolved)
    except Exception as error:  # whatever fails to read, the draft model cannot be used
        raise ValueError(f"speculative_draft_model_path {path!r} cannot be loaded: "
                         f"{type(error).__name__}: {error}") from error
    check_vocab(load_config(target_path).vocab_size, draft.vocab_size, path)
    if args.draft_quantization == "gguf" and gguf_source(resolved) is None:
        raise ValueError(f"the draft model's quantization is 'gguf', which needs a .gguf file (or 'default'); "
                         f"speculative_draft_model_path {path!r} is a plain model directory")
    return dataclasses.replace(args, speculative_draft_model_path=resolved)


def check_vocab(target: int, draft: int, path: str) -> None:
    """Drafts are target token ids, and verify compares them with the target's argmax: one vocabulary."""
    if target != draft:
        raise ValueError(f"speculative_draft_model_path {path!r} has vocab_size {draft}, the target model "
                         f"{target}: a draft model must share the target's tokenizer and vocabulary")


def read_headers(model_dir: str) -> None:
    """Open every safetensors file's header (no tensor is read): a truncated or foreign file fails here."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            handle.keys()
