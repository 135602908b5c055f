"""The grammar backends by name (engine argument grammar_backend): the one table that make_backend builds from, that
"auto" draws its backends from, and that runtime/config.py's validation and CLI choices read.

Each factory imports its backend's module when called, so naming a backend (config validation, `--help`) imports
none of xgrammar, llguidance, outlines-core or torch. runtime/registry.py holds the runtime's named choices, but
grammars/ sits below the runtime (the runtime imports it), so this table is plain data that runtime/config.py
registers there instead of registering itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch (which base.py imports) stays unimported for config validation
    from .base import GrammarBackend

# tokenizer, vocab_size, stop_token_ids, compile_timeout_s -> backend
Factory = Callable[[object, int, list[int], float], "GrammarBackend"]
NONE = "none"


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 compile_timeout_s: float) -> GrammarBackend | None:
    """The backend chosen by engine argument `grammar_backend`; None for "none"."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar_backend {name!r}")
    factory = BACKENDS[name]
    return None if factory is None else factory(tokenizer, vocab_size, stop_token_ids, compile_timeout_s)


def _auto(tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float) -> GrammarBackend:
    from .auto import BACKENDS as AUTO_BACKENDS
    from .auto import AutoBackend

    return AutoBackend({name: make_backend(name, tokenizer, vocab_size, stop_token_ids, compile_timeout_s)
                        for name in AUTO_BACKENDS})


def _xgrammar(tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float) -> GrammarBackend:
    from .xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)


def _llguidance(tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float) -> GrammarBackend:
    from .llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)


def _outlines(tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float) -> GrammarBackend:
    from .outlines_backend import OutlinesBackend

    # Only outlines-core compiles in a child process, so only it is given the compile limit to kill at.
    return OutlinesBackend(tokenizer, stop_token_ids, compile_timeout_s)


# In the order `--help` lists them; "none" builds no backend (the engine serves no constraints).
BACKENDS: dict[str, Factory | None] = {
    "auto": _auto,
    "xgrammar": _xgrammar,
    "llguidance": _llguidance,
    "outlines": _outlines,
    NONE: None,
}
