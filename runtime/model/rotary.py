"""Rotary position embeddings as the families use them: one table per kind of layer.

Most models rotate every layer the same way. Gemma 3 gives its sliding-window layers their own base; SmolLM3
leaves some layers unrotated (NoPE); Phi-4-mini rotates only the first part of each head (partial rotary);
Phi-3's LongRoPE switches to its long factors once a request outgrows the original context; Qwen2-VL's text
model rotates by three positions (M-RoPE). Inverse frequencies of every scaled kind come from transformers, so
they are HF's to the bit.

LongRoPE: a forward rotates a request's tokens by the long factors when the request's context (a prompt's whole
length while it is prefilled in chunks) is past the original one, so a prompt past it is HF's from its first
token and one that ends before it is HF's to its last. HF's Phi-3 recomputes a request's whole cache with the
long factors at the step it crosses; here keys cached before keep their short rotation (as in vLLM and SGLang),
so a request that crosses while decoding, or a long prompt that reuses a short request's cached prefix, continues
from those keys.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

CosSin = tuple[torch.Tensor, torch.Tensor]


def rope_parameters(config, layer_type: str | None) -> dict:
    """The rope settings of one layer type (Gemma 3 nests them by type), or the model's."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    return dict(rope.get(layer_type) or {}) if is_per_layer_type(rope) else rope


def is_per_layer_type(rope: dict) -> bool:
    """Whether rope settings are nested by layer type (Gemma 3's {"sliding_attention": {...}, ...})."""
    return bool(rope) and all(isinstance(value, dict) for value in rope.values())


class RotaryEmbedding(nn.Module):
    """One rotary table; `rotary_dim` < head_dim rotates only the leading dimensions of each head."""

    def __init__(self, config, head_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        rope = rope_parameters(config, layer_type)
        rope_type = rope.get("rope_type", "default")
        self.rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        self.long_after: int | None = None
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            inv_freq, self.attention_scaling = 1.0 / (base**exponents), 1.0
        else:
            init = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, self.attention_scaling = init(config, "cpu", layer_type=layer_type)
            if rope_type == "longrope":
                self.long_after = int(rope["original_max_position_embeddings"])
                long_freq, _ = init(config, "cpu", seq_len=self.long_after + 1, layer_type=layer_type)
                self.register_buffer("long_inv_freq", long_freq.float(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None) -> CosSin:
        """long_rows [T] bool (LongRoPE): the tokens of requests longer than the original context."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if long_rows is not None:
            long_freqs = positions[:, None].float() * self.long_inv_freq[None, :]
            freqs = torch.where(long_rows[:, None], long_freqs, freqs)
        return self.cos_sin(freqs, dtype)

    def cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> CosSin:
        """([T, 1, rotary_dim] cos, the same shape of sin with its first half negated): apply_rotary's tables,
        shaped to broadcast over the heads and signed so that its rotation is a roll, once per forward."""
        cos, sin = ((t * self.attention_scaling).to(dtype)[:, None, :] for t in (freqs.cos(), freqs.sin()))
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's M-RoPE: the frequencies split in `mrope_section` parts that rotate by the temporal, height and
    width position in turn. Positions [3, T] (a prefill showing an image) or [T] (the same on all three axes:
    plain rotary, what decode and text-only batches pass)."""

    def __init__(self, config, head_dim: int, sections: list[int]) -> None:
        super().__init__(config, head_dim)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} does not split the {head_dim // 2} rotary frequencies")
        self.sections = list(sections)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None) -> CosSin:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.sections, dim=-1))], dim=-1)
        return self.cos_sin(freqs, dtype)


def layer_rope_kinds(config) -> list[str | None]:
    """Which table each layer rotates by: its layer type where rope settings differ by type, "all" where they do
    not, None for a layer without rotary (SmolLM3's `no_rope_layers` marks rotary layers 1, NoPE layers 0)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    layer_types = getattr(config, "layer_types", None)
    kinds: list[str | None] = (list(layer_types) if is_per_layer_type(rope) and layer_types
                               else ["all"] * config.num_hidden_layers)
    uses_rope = getattr(config, "no_rope_layers", None)
    return [kind if uses_rope is None or uses_rope[i] else None for i, kind in enumerate(kinds)]


class LayerRotary(nn.Module):
    """The rotary tables a model's layers use, computed once per forward and shared by the layers of a kind."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        self.layer_kinds = layer_rope_kinds(config)
        kinds = sorted({kind for kind in self.layer_kinds if kind is not None})
        self.tables = nn.ModuleDict({kind: rotary_embedding(config, head_dim, kind) for kind in kinds})

    @property
    def long_after(self) -> int | None:
        """LongRoPE's original context (requests longer than it rotate by the long factors), or None."""
        return next((t.long_after for t in self.tables.values() if t.long_after is not None), None)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                long_rows: torch.Tensor | None = None) -> list[CosSin | None]:
        """Each layer's (cos, sin), or None for a layer without rotary."""
        computed = {kind: table(positions, dtype, long_rows) for kind, table in self.tables.items()}
        return [None if kind is None else computed[kind] for kind in self.layer_kinds]


def rotary_embedding(config, head_dim: int, layer_type: str = "all") -> RotaryEmbedding:
    """M-RoPE for a config with an `mrope_section` (Qwen2-VL's text model), plain rotary otherwise."""
    per_type = layer_type if layer_type != "all" else None
    sections = rope_parameters(config, per_type).get("mrope_section")
    return MRotaryEmbedding(config, head_dim, sections) if sections else RotaryEmbedding(config, head_dim, per_type)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; the tables of cos_sin ([T, 1, rotary_dim]) rotate its first rotary_dim
    dimensions. HF's x * cos + cat(-x2, x1) * sin, in four ops: cat(x2, x1) is a roll by half, and the sign
    moved onto the table (-(a * b) == (-a) * b exactly), so the result is HF's to the bit."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]), dim=-1)
    return x * cos + x.roll(rotary_dim // 2, -1) * signed_sin
