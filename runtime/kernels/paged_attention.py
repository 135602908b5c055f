"""Attention read straight from the paged KV pool (paged_attention.c), for CPU batches: decode and prefill.

Gathering each request's K/V rows into a padded block and running SDPA on it moves every row twice more than
attention needs, and a padded, masked SDPA computes every key against every query of a bucket. At batch 32 with
~550-token contexts the gather and SDPA cost the default model more per decode step than its matmuls (a compiled
step: 150 of 255 ms). The C kernel reads each row once per tile of queries, where it lies in the pool, and never
reads keys past a tile's last position. Where the CPU has AVX512-BF16, bfloat16 pools are multiplied as bfloat16
(paged_attention_bf16.h): the same float32 results for less work a key; bfloat16_products() says whether a build does.

Eager forwards call the library through ctypes; a compiled decode step traces the registered op
furcate::paged_attention, whose CPU kernel is C++ (paged_attention_op.cpp, calling the same library) where that
builds. Built once per machine (native_build.py); without a compiler, attention keeps its torch
path (available() says why), and FURCATE_PAGED_ATTENTION=0 keeps it there too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import torch

from . import native_build

logger = logging.getLogger("furcate.paged_attention")

SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_attention.c"
OP_SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_attention_op.cpp"
DTYPES = (torch.float32, torch.bfloat16)


class Args(ctypes.Structure):
    """paged_attention.h's PagedAttentionArgs, field for field: the batch's tensors and shapes."""

    _fields_ = [("q", ctypes.c_void_p), ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p),
                ("pool_slots", ctypes.c_int64), ("slots", ctypes.c_void_p), ("table_len", ctypes.c_int64),
                ("spans", ctypes.c_void_p), ("batch", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int), ("scale", ctypes.c_float),
                ("out", ctypes.c_void_p), ("threads", ctypes.c_int), ("bf16", ctypes.c_int)]


# paged_attention.h's face: its entry points, its limits (query heads per KV head; head dimension, a multiple of
# LANES) and what its statuses mean (paged_attention_op.cpp says the same).
BINDING = native_build.Binding(
    entries=(native_build.Entry("paged_attention", (ctypes.POINTER(Args),), ctypes.c_int),
             native_build.Entry("paged_attention_bf16_products", (), ctypes.c_int)),
    limits={"MAX_GROUP": 16, "MAX_DIM": 256, "LANES": 16},
    errors={-1: "shapes beyond the kernel's limits", -2: "a request's tokens run past its slot table",
            -3: "out of memory"},
    structs={"PagedAttentionArgs": Args})
MAX_GROUP, MAX_DIM, LANES = (BINDING.limits[name] for name in ("MAX_GROUP", "MAX_DIM", "LANES"))
ERRORS = BINDING.errors


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernel built with native_build's flags and extra_flags (say -mno-avx512bf16 for the float path on every
    pool), building it if needed."""
    return BINDING.bind(native_build.load(SOURCE, extra_flags))


@functools.cache
def library() -> ctypes.CDLL | str:
    """The kernel, or why there is none."""
    return native_build.load_or_reason("FURCATE_PAGED_ATTENTION", load, logger,
                                       "paged attention kernel unavailable, attention gathers K/V for SDPA")


def available() -> bool:
    """Whether the kernel is built (and then its op has its CPU kernel)."""
    return native_build.available_with_op(library(), native_op)


def bfloat16_products(lib: ctypes.CDLL) -> bool:
    """Whether this build multiplies bfloat16 pools' numbers as bfloat16 (AVX512-BF16: paged_attention_bf16.h)
    rather than widening them to float32 (the same results, up to the order of float32 sums)."""
    return bool(lib.paged_attention_bf16_products())


@functools.cache
def native_op() -> bool:
    """Give furcate::paged_attention its CPU kernel once the library loads: paged_attention_op.cpp's where that
    builds, else attention() below; whether it is the C++ one."""
    return native_build.register_op_kernel(_LIBRARY, "paged_attention", OP_SOURCE, attention, logger,
                                           linked=(pathlib.Path(library()._name),))


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this attention shape and dtype (and is built): float32 or bfloat16."""
    return (dtype in DTYPES and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
            and head_dim <= MAX_DIM and head_dim % LANES == 0 and available())


def spans(first_rows: torch.Tensor, new_tokens: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    return torch.stack([first_rows, new_tokens, cached]).to(torch.int64)


def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
              spans: torch.Tensor, scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [T, H, D], the batch's new tokens packed request after request; k_pool and v_pool [slots, Hkv, D] of q's
    dtype (float32 or bfloat16), the new tokens' K/V written; kv_index [B, L] int64 and spans [3, B] (spans()) as
    attention/paged_table.py plans them (a slot outside the pool reads slot 0). Causal: each token sees its
    request's slots up to its own. Returns [T, H, D] of q's dtype, computed in float32. lib: a build of the kernel
    (load()), else the engine's."""
    q, kv_index, spans = q.contiguous(), kv_index.contiguous(), spans.contiguous()
    if not q.dtype == k_pool.dtype == v_pool.dtype or q.dtype not in DTYPES:
        raise ValueError(f"paged attention runs float32 or bfloat16, not {q.dtype} queries over a "
                         f"{k_pool.dtype}/{v_pool.dtype} pool")
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    args = Args(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[0], kv_index.data_ptr(),
                kv_index.shape[1], spans.data_ptr(), spans.shape[1], heads, k_pool.shape[1], dim, scale,
                out.data_ptr(), torch.get_num_threads(), q.dtype == torch.bfloat16)
    status = (lib or library()).paged_attention(ctypes.byref(args))
    if status:
        raise ValueError(f"paged attention: {ERRORS[status]} (up to {MAX_GROUP} query heads per KV head and "
                         f"head_dim {MAX_DIM}, a multiple of {LANES}; here {heads}/{k_pool.shape[1]} heads of "
                         f"{dim})")
    return out


# attention as an op a compiled graph can hold, registered at the low level (a CPU kernel and nothing else, given
# by library() once the kernel loads), as block_gemv is: torch.library.custom_op's wrappers cost microseconds a call.
_LIBRARY = torch.library.Library("furcate", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_index, Tensor spans, "
                "float scale) -> Tensor")


@torch.library.register_fake("furcate::paged_attention")
def _(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor, spans: torch.Tensor,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q)


attention_op = torch.ops.furcate.paged_attention.default
