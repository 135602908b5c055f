"""The block GEMV kernel (block_gemv.c): GGUF blocks times integer-coded activations, for decode's few rows.

torch's CPU int4 kernel converts every weight to float and, without native bfloat16, every activation too;
llama.cpp instead quantizes the activations to int8 per group of 32 and takes integer dot products (AVX512-VNNI,
or AVX2's byte multiply-add). block_gemv.c does that with two int8 digits per activation (about 15 bits, finer
than bfloat16), on torch's tensors. On a 2-core AVX512-VNNI Xeon it ran the default model's quantized layers
1.2x faster than torch's int4 and int8 kernels (7.5 -> 6.3 ms a step; its Q8_0 head 1.2-1.3x); built for AVX2
only, with torch held to AVX2 (no native bfloat16), 1.7x. It is built once
per machine with the system C compiler for the CPU it runs on (-march=native) and cached on disk; without a
compiler, or where the build fails, the engine keeps torch's kernels (available() says why).

Eager calls go straight to the library through ctypes (a registered op's Python round trip would cost more than
a small matmul); a compiled decode step traces the registered op furcate::block_gemv instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib
import threading
from collections.abc import Callable

import numpy as np
import torch

from . import native_build

logger = logging.getLogger("furcate.block_gemv")

SOURCE = pathlib.Path(__file__).parent / "csrc" / "block_gemv.c"
OP_SOURCE = pathlib.Path(__file__).parent / "csrc" / "block_gemv_op.cpp"
ISA_NAMES = {2: "AVX512-VNNI", 1: "AVX2", 0: "plain C"}


class Args(ctypes.Structure):
    """block_gemv.h's BlockGemvArgs, field for field: the activations, the packed weights, the output and
    scratch."""

    _fields_ = [("x", ctypes.c_void_p), ("x_bf16", ctypes.c_int), ("M", ctypes.c_int), ("K", ctypes.c_int),
                ("N", ctypes.c_int), ("w", ctypes.c_void_p), ("bits", ctypes.c_int), ("symmetric", ctypes.c_int),
                ("out", ctypes.c_void_p), ("out_bf16", ctypes.c_int), ("scratch", ctypes.c_void_p),
                ("lane_scratch", ctypes.c_void_p), ("threads", ctypes.c_int)]


# block_gemv.h's face: its entry points and its layout's sizes (weight rows a block holds; weights of a pair of
# 32-weight groups, the unit along K; per pair and row of x, the widest build's lanes of dx and of group sums).
BINDING = native_build.Binding(
    entries=(native_build.Entry("block_gemv", (ctypes.POINTER(Args),)),
             native_build.Entry("block_gemv_isa", (), ctypes.c_int)),
    limits={"ROWS": 4, "PAIR": 64, "LANE_FLOATS": 16},
    structs={"BlockGemvArgs": Args})
ROWS, PAIR, LANE_FLOATS = (BINDING.limits[name] for name in ("ROWS", "PAIR", "LANE_FLOATS"))
# Position j of a pair holds the weight at this offset within the pair (block_gemv.c's position_k).
_LANE = np.arange(PAIR) >> 2
POSITION_K = 32 * (_LANE & 1) + 4 * (_LANE >> 1) + (np.arange(PAIR) & 3)


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel built with native_build's flags and extra_flags (say -mno-avx512f for the AVX2 path), building
    it if needed; raises OSError or SubprocessError where it cannot be built or loaded."""
    return BINDING.bind(native_build.load(SOURCE, extra_flags))


_kernel = None  # the engine's C function, bound once library() has loaded it


@functools.cache
def library() -> ctypes.CDLL | str:
    """The engine's kernel, or why there is none (FURCATE_BLOCK_GEMV=0 turns it off: torch's kernels then)."""
    lib = native_build.load_or_reason("FURCATE_BLOCK_GEMV", load, logger,
                                      "block GEMV kernel unavailable, quantized layers use torch's kernels")
    if isinstance(lib, str):
        return lib
    logger.info("block GEMV kernel: %s", ISA_NAMES[lib.block_gemv_isa()])
    global _kernel
    _kernel = lib.block_gemv
    return lib


def available() -> bool:
    """Whether the kernel is built (and then its op has its CPU kernel)."""
    return native_build.available_with_op(library(), native_op)


@functools.cache
def native_op() -> bool:
    """Give furcate::block_gemv its CPU kernel once the library loads: block_gemv_op.cpp's where that builds, else
    _op_kernel; whether it is the C++ one (a compiled step then calls it without a trip into Python)."""
    return native_build.register_op_kernel(_LIBRARY, "block_gemv", OP_SOURCE, _op_kernel, logger,
                                           linked=(pathlib.Path(library()._name),))


def isa() -> str:
    """The vector path the engine's kernel runs, or why there is none."""
    lib = library()
    return lib if isinstance(lib, str) else ISA_NAMES[lib.block_gemv_isa()]


def symmetric(scale: np.ndarray, offset: np.ndarray, bits: int) -> bool:
    """Whether every offset is -2**(bits - 1) of its scale in float16 (Q4_0's and Q8_0's always are), so pack()
    can leave the offsets out and the kernel derive them, to the same float32 numbers."""
    derived = (scale.astype(np.float16).astype(np.float32) * -(1 << (bits - 1))).astype(np.float16)
    return bool(np.array_equal(derived, offset.astype(np.float16)))


def pack(u: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int, symmetric: bool = False) -> torch.Tensor:
    """u [N, K] unsigned weights (below 2**bits), scale and offset [N, K / 32] -> the kernel's bytes: blocks of
    ROWS rows (zero rows pad N), each pair of groups holding the block's rows' weights in position order, then
    their float16 (scale A, scale B, offset A, offset B), or (scale A, scale B) where symmetric (see symmetric());
    fits() says whether those are float16 numbers."""
    n, k = u.shape
    blocks, pairs = -(-n // ROWS), k // PAIR
    padded = blocks * ROWS
    positions = np.zeros((padded, pairs, PAIR), dtype=np.uint8)
    positions[:n] = u.reshape(n, pairs, PAIR)[:, :, POSITION_K]
    if bits == 4:
        positions = positions[:, :, :32] | (positions[:, :, 32:] << 4)
    stored = [scale] if symmetric else [scale, offset]
    factors = np.zeros((padded, pairs, 2 * len(stored)), dtype=np.float16)
    factors[:n] = np.concatenate([a.reshape(n, pairs, 2) for a in stored], axis=-1)
    # [block, row, pair, bytes] -> [block, pair, row, bytes], weights then factors
    weights = positions.reshape(blocks, ROWS, pairs, -1).transpose(0, 2, 1, 3).reshape(blocks, pairs, -1)
    factor_bytes = factors.view(np.uint8).reshape(blocks, ROWS, pairs, -1).transpose(0, 2, 1, 3)
    return torch.from_numpy(np.concatenate([weights, factor_bytes.reshape(blocks, pairs, -1)], axis=-1)
                            .reshape(blocks, -1))


def packed_bytes(n: int, k: int, bits: int, symmetric: bool = False) -> int:
    """What pack() writes for n rows of k weights: whole blocks of ROWS rows, each pair with 8 bytes of factors
    (4 where symmetric)."""
    return -(-n // ROWS) * ROWS * (k // PAIR) * (8 * bits + (4 if symmetric else 8))


def fits(scale: np.ndarray, offset: np.ndarray) -> bool:
    """Whether a tensor's scales and offsets are float16 numbers (GGUF's own blocks store them so; Q8_0's offset
    is 128 of its scales, and a corrupt file may hold anything)."""
    largest = float(np.finfo(np.float16).max)
    return all(bool((np.abs(a) <= largest).all()) for a in (scale, offset))  # NaN compares False


_scratch = threading.local()  # per thread: an engine's forward and a start-up timing never share one


def scratch(nbytes: int) -> int:
    """The address of a reusable buffer of at least nbytes for the quantized activations and their lanes."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer.data_ptr()


def gemv(x: torch.Tensor, weight: torch.Tensor, n: int, bits: int, symmetric: bool = False,
         kernel: Callable[..., None] | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, contiguous) times the n rows pack() wrote: [M, n] in x's dtype. kernel:
    another build's block_gemv (load(...).block_gemv, taking an Args) in place of the engine's."""
    m, k = x.shape
    expected = packed_bytes(n, k, bits, symmetric)
    if weight.numel() != expected:  # released weights (RL) or a foreign tensor: no C read past it
        raise ValueError(f"block GEMV weights hold {weight.numel()} bytes, not the {expected} of {n} rows of {k} "
                         f"{bits}-bit weights (weights released?)")
    out = torch.empty(m, n, dtype=x.dtype)
    activations = scratch(2 * m * k + 8 * m * (k // PAIR) * LANE_FLOATS)
    bf16 = x.dtype == torch.bfloat16
    lanes = activations + 2 * m * k  # after the two digits of each activation
    args = Args(x.data_ptr(), bf16, m, k, n, weight.data_ptr(), bits, symmetric, out.data_ptr(), bf16, activations,
                lanes, torch.get_num_threads())
    (kernel or _kernel)(ctypes.byref(args))
    return out


def _op_kernel(x: torch.Tensor, weight: torch.Tensor, n: int, bits: int, symmetric: bool) -> torch.Tensor:
    return gemv(x.contiguous(), weight, n, bits, symmetric)


# gemv as an op a compiled graph can hold: furcate::block_gemv. Defined with the low-level registration, a CPU
# kernel and nothing else (given by library() once the kernel loads: block_gemv_op.cpp's where it builds, else
# _op_kernel), because torch.library.custom_op's wrappers cost ~7 us more a call (one in six milliseconds of the
# default model's compiled step).
_LIBRARY = torch.library.Library("furcate", "FRAGMENT")
_LIBRARY.define("block_gemv(Tensor x, Tensor weight, int n, int bits, bool symmetric) -> Tensor")


@torch.library.register_fake("furcate::block_gemv")
def _(x: torch.Tensor, weight: torch.Tensor, n: int, bits: int, symmetric: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


gemv_op = torch.ops.furcate.block_gemv.default
