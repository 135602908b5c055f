"""bfloat16 linears on CPU through oneDNN with their weights reordered once, at load.

`F.linear` in bfloat16 already runs oneDNN on CPU, but it reorders the weight into oneDNN's blocked layout on
every call. Reordering once and calling oneDNN's linear with the result gives the same numbers (the same kernel on
the same layout: bit for bit, which tests/test_packed_linear.py checks on the machine it runs on) and was 1.3-3x
faster per call on an AMD EPYC with avx512_bf16 (a 3072x576 layer: 117 -> 40 us at 1 row, 216 -> 98 us at 16);
the default model's bfloat16 decode at batch 8 went from 224-241 to 320-329 tokens/s.

The reordered copy is an opaque oneDNN tensor beside the parameter, which stays as it was: checkpoint loading,
weight updates and state dicts see ordinary tensors. Whoever writes a parameter's data repacks (rank_control.py
after a weight update, after resuming released weights); releasing weights drops the copies. A compiled step
traces the plain linear (oneDNN's opaque tensors do not compile), so enable_torch_compile is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Linear):
    """nn.Linear whose eager forward reads its oneDNN-reordered weight (`packed`; None: the plain linear)."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.packed is None:  # dynamo never reads the opaque tensor
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def repack(self) -> None:
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if weight.numel() else None


def packs(dtype: torch.dtype, device: str) -> bool:
    """Whether linears of this dtype on this device are packed: bfloat16 on a CPU whose oneDNN runs it natively."""
    return (device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of the model into a PackedLinear in place (the same object and parameters, so
    whatever holds a layer keeps it) and pack it; the number packed. Tensor-parallel layers stay as they are."""
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    for module in linears:
        module.__class__ = PackedLinear
        module.repack()
    return len(linears)


def repack_linears(model: nn.Module) -> None:
    """After a parameter's data was written or replaced: every PackedLinear packs its weight again."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.repack()


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies (their memory goes with the released weights); forwards run the plain linear."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.packed = None
