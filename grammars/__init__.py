"""Constrained decoding: a small backend protocol with xgrammar, llguidance and outlines-core behind it, chosen by
name in registry.py (grammar_backend="auto" picks among them per spec)."""

from .spec import ANY_JSON, GrammarSpec

__all__ = ["ANY_JSON", "GrammarSpec"]
