"""RMSNorm, the SiLU-gated product and q/k rotary, each one pass in C (fused_elementwise.c), for eager CPU float32
and bfloat16 forwards.

A 2,048-token prefill chunk of the default model spent 0.9 of its 2.6 s in these steps as torch ops (profiled on a
2-core Xeon, 2026-12-06): each op reads and writes activations larger than the caches, and the norm, gate and
rotation take five, three and five such passes. Fused, each reads its input once and writes once.

bfloat16 rows round where torch's bfloat16 ops round. Compiled decode graphs keep the torch ops (inductor fuses
those itself). Built once per machine (native_build.py); without a compiler, or with
FURCATE_FUSED_ELEMENTWISE=0, the torch ops run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib
from collections.abc import Callable

import torch

from . import native_build

logger = logging.getLogger("furcate.fused_elementwise")

SOURCE = pathlib.Path(__file__).parent / "csrc" / "fused_elementwise.c"
# torch rounds every product and sum on its own; a contracted multiply-add would round once.
FLAGS = ("-ffp-contract=off",)
# Below this many elements a call runs on one thread: waking the others costs more than the work.
PARALLEL_ELEMENTS = 1 << 15
INT64, INT, FLOAT, POINTER = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class RotaryArgs(ctypes.Structure):
    """fused_elementwise.h's RotaryArgs, field for field: qkv's rows, the tables, q and k out, their shapes."""

    _fields_ = [("qkv", POINTER), ("row_stride", INT64), ("cos", POINTER), ("signed_sin", POINTER),
                ("q_out", POINTER), ("k_out", POINTER), ("rows", INT64), ("q_heads", INT), ("k_heads", INT),
                ("dim", INT), ("rot", INT), ("threads", INT)]


def both_dtypes(name: str, argtypes: tuple[object, ...]) -> tuple[native_build.Entry, ...]:
    """An entry point and its _bf16 twin: the same arguments (pointers to float32 or to bfloat16)."""
    return native_build.Entry(name, argtypes), native_build.Entry(name + "_bf16", argtypes)


# fused_elementwise.h's face: each step for float32 and for bfloat16.
BINDING = native_build.Binding(
    entries=(*both_dtypes("rms_norm", (POINTER, POINTER, POINTER, INT64, INT64, FLOAT, INT)),
             *both_dtypes("silu_mul", (POINTER, POINTER, INT64, INT64, INT)),
             *both_dtypes("rotary_qk", (ctypes.POINTER(RotaryArgs),))),
    structs={"RotaryArgs": RotaryArgs})


def load() -> ctypes.CDLL:
    return BINDING.bind(native_build.load(SOURCE, FLAGS))


@functools.cache
def library() -> ctypes.CDLL | str:
    """The kernels, or why there are none."""
    return native_build.load_or_reason("FURCATE_FUSED_ELEMENTWISE", load, logger,
                                       "fused elementwise kernels unavailable, torch ops run instead")


def available() -> bool:
    return not isinstance(library(), str)


DTYPES = (torch.float32, torch.bfloat16)


def serves(x: torch.Tensor) -> bool:
    """Whether x's step runs here: an eager CPU float32 or bfloat16 tensor (a graph being traced keeps torch's
    ops)."""
    return (x.dtype in DTYPES and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and available())


def kernel(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The library's function for this dtype (the _bf16 variant for bfloat16)."""
    return getattr(library(), name + ("_bf16" if dtype == torch.bfloat16 else ""))


def threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_ELEMENTS else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over x's last dimension; x contiguous, weight of x's dtype (in
    bfloat16 the normalised rows are rounded before the weight's product, as HF's Llama norm does)."""
    out = torch.empty_like(x)
    width = x.shape[-1]
    kernel("rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps,
                                threads(x.numel()))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (contiguous), gate its first I columns."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    kernel("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, inter, threads(gate_up.numel()))
    return out


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, q_heads: int, k_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, q_heads, head_dim] and k [T, k_heads, head_dim], contiguous, from the leading columns of qkv [T, W]
    (unit column stride), rotated by cos_sin's tables ([T, 1, rotary_dim], contiguous) as apply_rotary does."""
    rows, rot = qkv.shape[0], cos.shape[-1]
    q, k = qkv.new_empty(rows, q_heads, head_dim), qkv.new_empty(rows, k_heads, head_dim)
    args = RotaryArgs(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                      rows, q_heads, k_heads, head_dim, rot, threads(q.numel() + k.numel()))
    kernel("rotary_qk", qkv.dtype)(ctypes.byref(args))
    return q, k
