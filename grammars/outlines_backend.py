"""outlines-core: JSON schema (via its schema-to-regex) and regex, over a vocabulary built offline from the
tokenizer (outlines' own Vocabulary.from_pretrained would call the hub)."""

from __future__ import annotations

import json
import re

import torch
from outlines_core import Guide, Index, Vocabulary

from .base import Fidelity
from .isolated import compile_isolated
from .regex_dialect import with_ascii_classes
from .spec import ANY_JSON, GrammarSpec

MAX_ROLLBACK = 200
# Bounds one compile's own allocations; some schemas' DFAs grow past 16 GB.
COMPILE_MEMORY_LIMIT_BYTES = 4 << 30


def gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character byte-level BPE uses for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def build_vocabulary(tokenizer, eos_token_id: int) -> Vocabulary:
    """Token bytes -> ids for every non-special token, decoding byte-level or sentencepiece spellings."""
    byte_decoder = gpt2_byte_decoder()
    special = set(tokenizer.all_special_ids)
    byte_level = "ByteLevel" in type(tokenizer.backend_tokenizer.decoder).__name__ or all(
        ch in byte_decoder for ch in tokenizer.convert_ids_to_tokens(tokenizer.encode(" a")))
    sentencepiece_byte = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
    mapping: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id == eos_token_id:
            continue
        if byte_level and all(ch in byte_decoder for ch in token):
            raw = bytes(byte_decoder[ch] for ch in token)
        elif match := sentencepiece_byte.match(token):
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = token.replace("\u2581", " ").encode()
        mapping.setdefault(raw, []).append(token_id)
    return Vocabulary(eos_token_id, mapping)


class OutlinesMatcher:
    def __init__(self, index: Index, eos_token_id: int) -> None:
        self._guide = Guide(index, max_rollback=MAX_ROLLBACK)
        self._eos = eos_token_id
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        target.zero_()
        self._guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    def accept(self, token: int) -> bool:
        if self._terminated:
            return False
        if token == self._eos:  # the stop token ends a match that is complete here
            self._terminated = self._guide.is_finished()
            return self._terminated
        if not self._guide.accepts_tokens([token]):
            return False
        self._guide.advance(token, return_tokens=False)
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if self._terminated:  # the stop token never advanced the guide
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    def jump_forward(self) -> str:
        # outlines-core exposes no forced-string query; jump-forward is an xgrammar feature here.
        return ""


class OutlinesCompiled:
    def __init__(self, index: Index, eos_token_id: int, fidelity: Fidelity) -> None:
        self.index = index
        self.eos_token_id = eos_token_id
        self.fidelity = fidelity

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self.index, self.eos_token_id)


class OutlinesBackend:
    name = "outlines"

    def __init__(self, tokenizer, stop_token_ids: list[int], compile_timeout_s: float) -> None:
        self.eos_token_id = stop_token_ids[0]
        self.compile_timeout_s = compile_timeout_s
        self._vocabulary = build_vocabulary(tokenizer, self.eos_token_id)

    def compile(self, spec: GrammarSpec) -> OutlinesCompiled:
        kind, source = self._source(spec)
        departures: list[str] = []
        if spec.kind == "regex":  # outlines-core's \d and \w are Unicode classes
            source, departures = with_ascii_classes(source)
        try:
            index, approximations = compile_isolated(kind, source, self._vocabulary, self.compile_timeout_s,
                                                     COMPILE_MEMORY_LIMIT_BYTES)
        except ValueError as error:
            raise ValueError(f"{spec.kind} does not compile with outlines-core: {error}") from None
        fidelity = Fidelity(self.name, tuple(approximations) + tuple(departures))
        return OutlinesCompiled(index, self.eos_token_id, fidelity)

    @staticmethod
    def _source(spec: GrammarSpec) -> tuple[str, str]:
        """What the compile child builds from: ("regex", regex) or ("json_schema", schema)."""
        if spec.kind == "regex":
            return "regex", spec.spec
        if spec.kind == "choices":
            return "regex", "|".join(re.escape(choice) for choice in json.loads(spec.spec))
        if spec.kind == "json_schema" and spec.spec != ANY_JSON:
            return "json_schema", spec.spec
        what = "free-form JSON (json_object)" if spec.kind == "json_schema" else spec.kind
        raise ValueError(f"the outlines backend does not support {what}; use grammar_backend='xgrammar'")
