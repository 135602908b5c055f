"""Layers shared by the decoder families: RMSNorm in each family's arithmetic, gated MLP, attention block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..distributed.parallel_state import SINGLE, TensorParallel
from ..distributed.tp_layers import row_linear
from ..kernels import fused_elementwise
from .rotary import CosSin, apply_rotary

# The activations our families name, as HF's ACT2FN computes them. Importing transformers.activations pulls in
# torch.distributed.tensor, ~0.7 s of every scheduler start, so it is imported only for any other name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class RMSNorm(nn.Module):
    """RMSNorm in the arithmetic order of the family's HF implementation, so float32 results match it bit for bit.

    style "llama": weight * x.to(dtype); "olmo": (weight * x).to(dtype); "gemma": the weight is stored as an offset
    from 1 and applied in float32, (x * (1 + weight)).to(dtype)."""

    def __init__(self, hidden_size: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if style == "gemma" else torch.ones(hidden_size))
        self.eps, self.style = eps, style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses(x):
            return fused_elementwise.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        return self.scale(x * torch.rsqrt(self.mean_square(x) + self.eps), dtype)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the fused kernel computes this norm: float32 rows in the Llama and OLMo styles (the same
        products in float32; Gemma's weight is an offset), bfloat16 rows in the Llama style (OLMo's rounds after
        the weight's product)."""
        styles = ("llama", "olmo") if x.dtype == torch.float32 else ("llama",)
        return (self.style in styles and x.is_contiguous() and self.weight.dtype == x.dtype
                and fused_elementwise.serves(x))

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1, keepdim=True)

    def scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.style == "gemma":
            return (normed * (1.0 + self.weight.float())).to(dtype)
        if self.style == "olmo":
            return (self.weight * normed).to(dtype)
        return self.weight * normed.to(dtype)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a width split across tensor-parallel ranks (OLMo 2's q/k norm over whole projections): each
    rank holds its columns and their weights; the mean square sums every rank's squares."""

    def __init__(self, full_size: int, eps: float, style: str, tp: TensorParallel) -> None:
        super().__init__(tp.shard(full_size), eps, style)
        self.full_size = full_size

    def fuses(self, x: torch.Tensor) -> bool:
        return False  # the kernel's mean square sees this rank's columns only

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        return squares / self.full_size


def rms_norm(full_size: int, eps: float, style: str, tp: TensorParallel = SINGLE) -> RMSNorm:
    """A norm over `full_size` features of which this rank holds its shard (all of them without tp)."""
    return RMSNorm(full_size, eps, style) if tp.size == 1 else ShardedRMSNorm(full_size, eps, style, tp)


class GatedMLP(nn.Module):
    """Gated MLP (SiLU for Llama, tanh-GELU for Gemma: the config's activation) with gate and up projections fused
    into one matmul. Under tensor parallelism each rank holds a slice of the intermediate columns (gate and up
    alike), and down_proj sums the slices."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, activation_name: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = tp.shard(intermediate_size)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp)
        self.act = activation(activation_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and gate_up.dim() == 2 and gate_up.is_contiguous() and fused_elementwise.serves(gate_up):
            return self.down_proj(fused_elementwise.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the whole model."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return num_heads, num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_heads


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention differs by family: biases, q/k norm, q/k/v clipping, softmax scale and cap,
    window."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: str | None  # "head": per head (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    norm_style: str
    scaling: float | None  # None: head_dim ** -0.5
    logit_cap: float | None  # tanh soft-capping of attention scores (Gemma 2)
    sliding_window: int | None
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after the q/k norms (OLMoE)


class Attention(nn.Module):
    """Multi-head attention with GQA, fused QKV, optional q/k RMSNorm and sliding window.
    Under tensor parallelism each rank holds a slice of the query heads and the matching slice of KV heads."""

    def __init__(self, config, layer_id: int, spec: AttentionSpec, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        num_heads, num_kv_heads, self.head_dim = attention_shape(config)
        self.num_heads, self.num_kv_heads = tp.shard(num_heads), tp.shard(num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5 if spec.scaling is None else spec.scaling
        self.sliding_window, self.logit_cap = spec.sliding_window, spec.logit_cap
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = row_linear(num_heads * self.head_dim, config.hidden_size, spec.o_bias, tp)
        self.q_norm, self.k_norm = qk_norms(config, spec, tp)
        self.norm_whole_projection = spec.qk_norm == "projection"
        self.clip_qkv = spec.clip_qkv

    def forward(self, x: torch.Tensor, rotary: CosSin | None, attn: AttentionBackend) -> torch.Tensor:
        """rotary: this layer's (cos, sin), or None for a layer without position embedding (NoPE)."""
        q, k, v = self.rotated(self.qkv_proj(x), rotary)
        if self.logit_cap is None:  # backends without soft-capping never see the argument
            return self.o_proj(attn.forward(q, k, v, self.layer_id, self.scaling, self.sliding_window))
        out = attn.forward(q, k, v, self.layer_id, self.scaling, self.sliding_window, logit_cap=self.logit_cap)
        return self.o_proj(out)

    def rotated(self, qkv: torch.Tensor, rotary: CosSin | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, KV heads, head_dim] of the fused projection, q and k rotated."""
        if self.q_norm is not None or self.clip_qkv is not None:
            return self.normed_rotated(qkv, rotary)
        if rotary is not None and fuses_rotary(qkv, rotary):
            q, k = fused_elementwise.rotary_qk(qkv, *rotary, self.num_heads, self.num_kv_heads, self.head_dim)
            return q, k, qkv[..., self.q_size + self.kv_size :].reshape(-1, self.num_kv_heads, self.head_dim)
        heads = self.num_heads + self.num_kv_heads
        # q and k side by side in the projection: one rotation over both heads' rows (a decode step's ops count).
        qk = qkv[..., : self.q_size + self.kv_size].reshape(-1, heads, self.head_dim)
        if rotary is not None:
            qk = apply_rotary(qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q.contiguous(), k, qkv[..., self.q_size + self.kv_size :].reshape(-1, self.num_kv_heads, self.head_dim)

    def normed_rotated(self, qkv: torch.Tensor,
                       rotary: CosSin | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rotated() for attention with q/k norms or clipping, which apply to q and k apart before the rotation."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_whole_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_whole_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return q, k, v


def fuses_rotary(qkv: torch.Tensor, rotary: CosSin) -> bool:
    """Whether the fused kernel rotates this projection: float32 or bfloat16 rows [T, W] with unit column
    stride, and cos_sin's tables (of that dtype) for those T tokens."""
    cos, signed_sin = rotary
    return (qkv.dim() == 2 and qkv.stride(1) == 1 and cos.dtype == qkv.dtype and cos.shape[0] == qkv.shape[0]
            and cos.is_contiguous() and signed_sin.is_contiguous() and fused_elementwise.serves(qkv))


def qk_norms(config, spec: AttentionSpec, tp: TensorParallel) -> tuple[RMSNorm | None, RMSNorm | None]:
    """Per-head norms (one head_dim weight, shared by the heads) or norms over the whole q and k projections."""
    if spec.qk_norm is None:
        return None, None
    num_heads, num_kv_heads, head_dim = attention_shape(config)
    if spec.qk_norm == "head":
        return (RMSNorm(head_dim, config.rms_norm_eps, spec.norm_style),
                RMSNorm(head_dim, config.rms_norm_eps, spec.norm_style))
    return (rms_norm(num_heads * head_dim, config.rms_norm_eps, spec.norm_style, tp),
            rms_norm(num_kv_heads * head_dim, config.rms_norm_eps, spec.norm_style, tp))
