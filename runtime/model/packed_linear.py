"""CPU linears through oneDNN with their weights reordered once, at load: bfloat16 always, float32 where it wins.

`F.linear` in bfloat16 already runs oneDNN on CPU, but it reorders the weight into oneDNN's blocked layout on
every call. Reordering once and calling oneDNN's linear with the result gives the same numbers (the same kernel on
the same layout: bit for bit, which tests/test_packed_linear.py checks on the machine it runs on) and was 1.3-3x
faster per call on an AMD EPYC with avx512_bf16 (a 3072x576 layer: 117 -> 40 us at 1 row, 216 -> 98 us at 16);
the default model's bfloat16 decode at batch 8 went from 224-241 to 320-329 tokens/s.

float32's `F.linear` runs the BLAS (MKL), which on an AMD EPYC (Zen 5) ran at ~200 GFLOP/s where oneDNN with a
packed weight ran ~460: 2.3x at prefill's rows, 2-3.7x at decode's, the tied 49152-row LM head 2.6x at one row.
On an Intel Xeon the two were even at prefill's rows and oneDNN 10-30% ahead at 8-32. The two round differently
(float32 noise, ~1e-6 relative), so float32 packs only where a measurement on this CPU says it pays
(kernel_choice.packed_from_rows, per weight shape, kept on disk): a layer serves its packed copy from that many
rows on and F.linear below them.

The reordered copy is an opaque oneDNN tensor beside the parameter, which stays as it was: checkpoint loading,
weight updates and state dicts see ordinary tensors. Whoever writes a parameter's data repacks (rank_control.py
after a weight update, after resuming released weights); releasing weights drops the copies. Opaque tensors do
not compile, so a compiled step calls the op furcate::packed_linear with the ordinary weight, and the op finds the
layer's packed copy by the weight's address (a layer whose weight moved since it packed runs F.linear). Its CPU
kernel is C++ (packed_linear_op.cpp, built once per machine) so that a graph calls it without a trip into Python.
FURCATE_PACKED_LINEAR=0 packs nothing; =1 packs float32 too, from one row, without measuring.

At one row (batch-1 decode) oneDNN's call costs ~8-13 us before it streams the weight, ~1 ms of the default model's
step. packed_linear_op.cpp's dense GEMV streams each weight row from the ordinary weight at once; it serves one row
of the layers whose shape it measured faster on (kernel_choice.gemv_choice: 35-40% on the default model's bfloat16
shapes on an AMD EPYC, where the compiled bfloat16 batch-1 step went from 8.9-9.9 to 7.4-8.2 ms, and float32's
from 15.3-16.2 to 13.4-15.7). Built for float32 with AVX512F or AVX2 and bfloat16 with AVX512-BF16. A float32
layer that packs from no row (MKL's F.linear won at every rung, as it did held to AVX2) takes the GEMV at one row where
it measured faster than F.linear (held to AVX2, the float32 batch-1 step spent 54% of its samples in OpenMP's waits
around MKL's GEMV).
FURCATE_DENSE_GEMV=0 keeps one row on the packed copy or F.linear, =1 takes the GEMV without measuring.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import packed_linear as packed_linear_op_face
from .weights.loader import available_memory_bytes

logger = logging.getLogger("furcate.packed_linear")

# which layer packed the weight at an address (the compiled op's lookup)
_PACKERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


class PackedLinear(nn.Linear):
    """nn.Linear whose forward reads its oneDNN-reordered weight (`packed`; None: the plain linear) for inputs of
    `from_rows` rows or more (None: it never packs)."""

    packed: torch.Tensor | None = None
    from_rows: int | None = 1
    # One row runs the dense GEMV (packed_linear_op.cpp) where it measured faster. Private, so that a graph's key
    # (graph_cache.model_signature) leaves it out: the op chooses at run time, and a graph is the same either way.
    _gemv: bool = False

    @property
    def gemv(self) -> bool:
        return self._gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.run(x)
        # dynamo never reads the opaque tensor; the op serves what the layer chose (at::linear where nothing)
        return packed_linear_op(x, self.weight, self.bias)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.numel() == self.in_features:
            return packed_linear_op(x, self.weight, self.bias)
        if self.packed is None or self.from_rows is None or x.numel() < self.from_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def repack(self) -> None:
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if weight.numel() else None
        if self.packed is not None:
            _PACKERS[weight.data_ptr()] = self
            self.publish()

    def serve_from(self, rows: int | None, gemv: bool = False) -> None:
        """Serve the packed copy from this many rows on (None: never, and drop it), and one row by the dense GEMV
        or not."""
        self.from_rows, self._gemv = rows, gemv
        if rows is None:
            self.unpack()
        if self.packed is not None or gemv:
            self.publish()

    def publish(self) -> None:
        """Tell the op's C++ kernel (where it runs) what serves the weight: the packed copy (held weakly, so unpack
        needs no second call; None where the layer keeps none) and whether one row runs the dense GEMV."""
        if native_kernel():
            torch.ops.furcate.packed_register(self.weight, self.packed, self.from_rows or 0, self.gemv)

    def unpack(self) -> None:
        self.packed = None


def switch() -> str | None:
    """FURCATE_PACKED_LINEAR: "0" packs nothing, "1" packs float32 without measuring, unset measures."""
    return os.environ.get("FURCATE_PACKED_LINEAR")


def packs(dtype: torch.dtype, device: str) -> bool:
    """Whether linears of this dtype on this device may pack: bfloat16 on a CPU whose oneDNN runs it natively
    (always), float32 on any CPU with oneDNN (where kernel_choice measures it faster)."""
    if device != "cpu" or not torch.backends.mkldnn.is_available() or switch() == "0":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain nn.Linear layers (tensor-parallel ones are other classes and stay as they are)."""
    return [module for module in model.modules() if type(module) is nn.Linear]


def room_for_copies(linears: list[nn.Linear]) -> bool:
    """Whether the packed copies (as many bytes as the weights) take at most half the memory still free: a model
    near the machine's memory runs unpacked rather than failing to load or leaving no room for its KV cache."""
    copies = sum(layer.weight.numel() * layer.weight.element_size() for layer in linears)
    try:
        return copies <= available_memory_bytes() // 2
    except (OSError, RuntimeError, ValueError):  # no /proc/meminfo: nothing tells, as before
        return True


def pack_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of the model into a PackedLinear in place (the same object and parameters, so
    whatever holds a layer keeps it) and pack it; float32 layers keep the packed copy only from the rows where it
    measured faster. The number that serve a packed copy; none where the copies would not fit (room_for_copies)."""
    linears = plain_linears(model)
    native_kernel()  # the op has a kernel before any graph calls it
    if not room_for_copies(linears):
        logger.warning("linears not packed for oneDNN: their copies would take over half the free memory")
        return 0
    for module in linears:
        module.__class__ = PackedLinear
        module.repack()
    float32 = [layer for layer in linears if layer.weight.dtype == torch.float32]
    if float32 and switch() != "1":
        from .kernel_choice import packed_from_rows

        for layer, rows in zip(float32, packed_from_rows(float32)):
            layer.serve_from(rows)
    take_gemv_where_it_wins(linears)
    return sum(layer.packed is not None for layer in linears)


def gemv_takes(layer: PackedLinear) -> bool:
    """Whether the dense GEMV is built for the layer's dtype and takes its shape (whole vectors of 64 weights)."""
    return (native_kernel() and layer.in_features % 64 == 0 and layer.weight.is_contiguous()
            and torch.ops.furcate.dense_gemv_built(layer.weight.dtype))


def take_gemv_where_it_wins(linears: list[PackedLinear]) -> None:
    """One row runs the dense GEMV on the layers where it measured faster than what serves one row otherwise (the
    packed copy, or F.linear where float32 did not pack from one row), per dtype and weight shape
    (kernel_choice.gemv_choice; FURCATE_DENSE_GEMV=0: nowhere, =1: everywhere it takes)."""
    from .kernel_choice import gemv_choice

    switch = os.environ.get("FURCATE_DENSE_GEMV")
    for dtype in (torch.float32, torch.bfloat16):
        layers = [layer for layer in linears if layer.weight.dtype == dtype and gemv_takes(layer)]
        if not layers or switch == "0":
            continue
        for layer, wins in zip(layers, [True] * len(layers) if switch == "1" else gemv_choice(layers)):
            layer.serve_from(layer.from_rows, wins)


def repack_linears(model: nn.Module) -> None:
    """After a parameter's data was written or replaced, or released weights resumed: every PackedLinear that
    serves a packed copy packs its weight again, and one that serves only the GEMV tells the op its new weight."""
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.from_rows is not None:
            module.repack()
        elif isinstance(module, PackedLinear) and module.gemv:
            module.publish()


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies (their memory goes with the released weights); forwards run the plain linear."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.unpack()


def _op_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    layer = _PACKERS.get(weight.data_ptr())
    if layer is None or layer.weight.data_ptr() != weight.data_ptr() or layer.weight.shape != weight.shape:
        return F.linear(x, weight, bias)
    return layer.run(x)


@functools.cache
def native_kernel() -> bool:
    """Whether furcate::packed_linear runs its C++ kernel (kernels/packed_linear.py); otherwise _op_kernel above."""
    return packed_linear_op_face.native_kernel(_op_kernel)


packed_linear_op = packed_linear_op_face.packed_linear_op
