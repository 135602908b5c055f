"""Layers shared by the decoder families: RMSNorm, rotary embedding (and M-RoPE), gated MLP, attention block."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..attention.base import AttentionBackend
from ..distributed.parallel_state import SINGLE, TensorParallel
from ..distributed.tp_layers import row_linear


class RMSNorm(nn.Module):
    """Same arithmetic order as HF's LlamaRMSNorm, so float32 results match it bit for bit."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding; inverse frequencies (incl. llama3/yarn/linear scaling) come from transformers."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's M-RoPE: the frequencies split in `mrope_section` parts that rotate by the temporal, height and
    width position in turn. Positions [3, T] (a prefill showing an image) or [T] (the same on all three axes:
    plain rotary, what decode and text-only batches pass)."""

    def __init__(self, config, head_dim: int, sections: list[int]) -> None:
        super().__init__(config, head_dim)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} does not split the {head_dim // 2} rotary frequencies")
        self.sections = list(sections)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.sections, dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotary_embedding(config, head_dim: int) -> RotaryEmbedding:
    """M-RoPE for a config with an `mrope_section` (Qwen2-VL's text model), plain rotary otherwise."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sections = rope.get("mrope_section")
    return MRotaryEmbedding(config, head_dim, sections) if sections else RotaryEmbedding(config, head_dim)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul. Under tensor parallelism each rank holds
    a slice of the intermediate columns (gate and up alike), and down_proj sums the slices."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.intermediate_size = tp.shard(intermediate_size)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the whole model."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return num_heads, num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_heads


class Attention(nn.Module):
    """Multi-head attention with GQA, fused QKV, optional q/k RMSNorm (Qwen3) and sliding window (Mistral).
    Under tensor parallelism each rank holds a slice of the query heads and the matching slice of KV heads."""

    def __init__(
        self,
        config,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        num_heads, num_kv_heads, self.head_dim = attention_shape(config)
        self.num_heads, self.num_kv_heads = tp.shard(num_heads), tp.shard(num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = row_linear(num_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn.forward(q, k, v, self.layer_id, self.scaling, self.sliding_window)
        return self.o_proj(out)
