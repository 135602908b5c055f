"""Constrained decoding: a small backend protocol with xgrammar and outlines-core behind it."""

from .spec import ANY_JSON, GrammarSpec

__all__ = ["ANY_JSON", "GrammarSpec"]
