"""Incremental detokenization and stop-string trimming on the engine side."""

from __future__ import annotations

from ..wire.finish_reason import FinishReason

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Grows the text of an output one batch of tokens at a time without re-decoding everything.

    Tokens are decoded in a short window so byte-level pieces of one character are held back until the
    character is complete (no U+FFFD in streamed text).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self.kwargs)

    def update(self, all_ids: list[int]) -> str:
        """all_ids: every output token so far. Returns the text so far."""
        prefix_text = self.decode(all_ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(all_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_ids)
        return self.text


def trim_stop(text: str, finish_reason: FinishReason | None, no_stop_trim: bool) -> str:
    """Cut the text at the stop string that ended it; the scheduler stopped on its first occurrence."""
    matched = finish_reason.stop_text if finish_reason is not None else None
    if no_stop_trim or matched is None:
        return text
    index = text.find(matched)
    return text if index < 0 else text[:index]


def stream_holdback(stop: list[str]) -> int:
    """Characters to withhold while streaming, so text that may become part of a stop string is never sent."""
    return max((len(s) for s in stop), default=1) - 1
