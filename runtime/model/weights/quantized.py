"""Weight-only quantized linear layers, built from a GGUF's blocks without a float detour: on block_gemv.c where
it builds (BlockGemvLinear: the GGUF's own groups and float16 factors, Q8_0's included), else on torch's CPU
kernels (Int4Linear, Int8Linear), which the rest of this docstring describes.

GGUF stores a row in blocks of 32 weights sharing a scale (and, for Q4_1, a minimum): w = q * scale + offset.
Q4_K's 256-weight super-blocks are eight such groups whose scale and offset are 6-bit multiples of two float16
numbers per super-block. Q4_0, Q4_1 and Q4_K map exactly onto torch's int4 kernel with groups of 32, whose
dequantization is (q - 8) * scale + zero, so zero = offset + 8 * scale; the kernel keeps scale and zero in
bfloat16, one rounding of each (for Q4_K as for Q4_1). Q8_0's per-block scales have no int8 kernel in torch
(`_weight_int8pack_mm` scales whole rows), so Q8_0 rows are requantized to one scale per row: a second rounding,
measured by the quality figures in benchmarks/results/quantized.md. Scales and activations are bfloat16, the
kernels' fast path. Q6_K (Q4_K_M files' other type: 6-bit quants in groups of 16 with int8 scales) fits neither
kernel's groups, so its tensors are not read here and load dense, dequantized by the conversion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K
from torch import nn

from ...kernels import block_gemv

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0",)
SUPPORTED_TYPES = INT4_TYPES + INT8_TYPES


@dataclass
class BlockWeights:
    """A quantized [N, K] matrix as GGUF blocks: w[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32]."""

    kind: str
    q: np.ndarray  # [N, K] integers
    scale: np.ndarray  # [N, K / 32] float32
    offset: np.ndarray  # [N, K / 32] float32

    def take_rows(self, order: np.ndarray) -> BlockWeights:
        return BlockWeights(self.kind, self.q[order], self.scale[order], self.offset[order])

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        # float32 arithmetic, as gguf.quants dequantizes (bit-equal for Q4_1, Q4_K and Q8_0).
        groups = self.q.reshape(n, k // GROUP, GROUP).astype(np.float32)
        return torch.from_numpy((groups * self.scale[..., None] + self.offset[..., None]).reshape(n, k))


def read_blocks(kind: str, data: np.ndarray, rows: int, cols: int) -> BlockWeights:
    """Decode a GGUF tensor's raw bytes (uint8 [rows, bytes per row]) of a type in SUPPORTED_TYPES."""
    weights_per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = np.ascontiguousarray(data).reshape(rows, cols // weights_per_block, block_bytes)
    q, scale, offset = _READERS[kind](blocks)
    return BlockWeights(kind, q.reshape(rows, cols).astype(np.int32), scale.reshape(rows, -1),
                        offset.reshape(rows, -1))


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields of blocks (uint8 [..., 2]) as float32 [...]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    # The low nibbles of a run of 16 bytes hold a group's first 16 weights, the high nibbles its last 16;
    # Q4_K's runs are 32 bytes, holding two groups, low nibbles the first.
    return np.stack([raw & 15, raw >> 4], axis=-2)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:]), scale, -8.0 * scale


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(blocks[..., 4:]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = _f16(blocks[..., 0:2])
    return blocks[..., 2:].copy().view(np.int8), scale, np.zeros_like(scale)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 256-weight super-block: float16 d and dmin, eight 6-bit (scale, min) pairs, 4-bit quants; sub-block j
    is w = q * (d * sc_j) - dmin * m_j, so Q4_1 with scale d * sc_j and offset -dmin * m_j (float32 products,
    as gguf.quants computes them)."""
    rows, supers, _ = blocks.shape
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(rows * supers, Q4_K.K_SCALE_SIZE))
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    scale = d * sc.reshape(rows, supers, 8).astype(np.float32)
    offset = -(dmin * m.reshape(rows, supers, 8).astype(np.float32))
    return _nibbles(blocks[..., 16:].reshape(rows, supers, 4, 32)), scale, offset


# GGUF type -> reader of its blocks (uint8 [rows, blocks per row, bytes per block]) into (q, scale, offset).
_READERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k}


def stack_rows(parts: list[BlockWeights]) -> BlockWeights:
    """Matrices of one kind stacked along the output dimension (a fused QKV or gate/up projection)."""
    if len({p.kind for p in parts}) != 1:
        raise ValueError(f"cannot fuse quantization types {[p.kind for p in parts]}")
    return BlockWeights(parts[0].kind, *(np.concatenate([getattr(p, f) for p in parts])
                                         for f in ("q", "scale", "offset")))


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W in groups of 32 int4 weights, on torch's CPU int4 kernel."""

    def __init__(self, weights: BlockWeights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.q.shape
        scale = torch.from_numpy(weights.scale)
        zero = torch.from_numpy(weights.offset) + 8 * scale
        # [K / 32, N, 2]: the kernel's layout of per-group (scale, zero).
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(weights.q), 1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W as int8 rows, one scale per row, on torch's CPU int8 kernel."""

    def __init__(self, weights: BlockWeights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.q.shape
        dense = weights.dequantize()
        row_scale = dense.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(dense / row_scale[:, None]).to(torch.int8))
        self.register_buffer("row_scale", row_scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight_int8, self.row_scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class BlockGemvLinear(nn.Module):
    """y = x W^T (+ b) on block_gemv.c: the GGUF's own groups (Q8_0's too, unlike Int8Linear), activations coded
    as two int8 digits per group of 32 for integer dot products (llama.cpp codes them with one)."""

    def __init__(self, weights: BlockWeights, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not block_gemv.available():
            raise RuntimeError(f"the block GEMV kernel is unavailable: {block_gemv.isa()}")
        self.out_features, self.in_features = weights.q.shape
        self.bits = 4 if weights.kind in INT4_TYPES else 8
        unsigned, offset = self.unsigned(weights)
        # Q4_0's and Q8_0's offsets follow from their scales: leaving them out reads the GGUF's bytes, not 11% more.
        self.symmetric = block_gemv.symmetric(weights.scale, offset, self.bits)
        self.register_buffer("packed", block_gemv.pack(unsigned, weights.scale, offset, self.bits, self.symmetric))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @staticmethod
    def unsigned(weights: BlockWeights) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's unsigned weights and offsets: Q8_0's signed q as q + 128, its offset -128 scales."""
        if weights.kind in INT4_TYPES:
            return weights.q, weights.offset
        return weights.q + 128, weights.offset - 128 * weights.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        if torch.compiler.is_compiling():
            out = block_gemv.gemv_op(flat, self.packed, self.out_features, self.bits, self.symmetric)
        else:
            out = block_gemv.gemv(flat.contiguous(), self.packed, self.out_features, self.bits, self.symmetric)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantized_linear(weights: BlockWeights, bias: torch.Tensor | None, for_graphs: bool = False) -> nn.Module:
    """The block GEMV kernel where it is built and the rows are whole pairs of groups; torch's kernels else.
    for_graphs (compiled decode): 4-bit layers take torch's int4 kernel where block_gemv's op runs its Python
    kernel, whose call cost more than it saved on small layers (measured on the default model: the compiled step
    took 16.8 ms with it, 14.2 ms without); with its C++ kernel (block_gemv_op.cpp) the step took 3.4-3.6 ms (one
    run of four: 4.2) against int4's 4.5-4.7 (AMD EPYC with avx512_bf16, 2026-12-06). Q8_0 layers always take it
    (a faster kernel than torch's int8, and GGUF's own blocks rather than a requantized row)."""
    if for_graphs and weights.kind in INT4_TYPES and not (block_gemv.available() and block_gemv.native_op()):
        return Int4Linear(weights, bias)
    if (block_gemv.available() and weights.q.shape[1] % block_gemv.PAIR == 0
            and block_gemv.fits(weights.scale, BlockGemvLinear.unsigned(weights)[1])):
        return BlockGemvLinear(weights, bias)
    return Int4Linear(weights, bias) if weights.kind in INT4_TYPES else Int8Linear(weights, bias)


class SmallBatchQuantized(nn.Module):
    """The quantized kernel for up to `max_rows` rows, the dense layer above: torch's int4/int8 kernels beat a
    dense matmul only for a handful of rows (on an avx512_bf16 core int4 was 2.4x faster at 1 row, even at 8 and
    1.7x slower at 24), so decode of small batches reads 4-bit weights while prefill and big batches stay dense.
    quantization=auto measures max_rows on the CPU it runs on (kernel_choice.py)."""

    def __init__(self, quantized: nn.Module, dense: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.quantized, self.dense, self.max_rows = quantized, dense, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.quantized(x) if rows <= self.max_rows else self.dense(x)


@dataclass(frozen=True)
class QuantizedModel:
    """What apply_quantization swapped: the layers, and the most rows a forward runs them for (-1: every batch)."""

    layers: list[str] = field(default_factory=list)
    max_rows: int = 0
