"""Triton attention kernels over the paged KV pool: split-KV decode and causal extend (prefill).

Both read keys and values through a flattened slot plan: request b's KV positions 0 .. seq_len-1 live at slots
kv_indices[kv_indptr[b] .. kv_indptr[b+1]] of the token-major pool buffers [slots, num_kv_heads, head_dim], and
its new queries are rows qo_indptr[b] .. qo_indptr[b+1] of q (the last extend_len positions of the request).

Softmax runs online (running max, running sum, rescaled accumulator) in float32 and in base 2: the scale is
folded with log2(e) so each block costs one exp2. head_dim is padded to a power of two (at least 16, the
smallest tl.dot operand) and masked, so 80 or 96 work like 64 or 128. Sliding window: key allowed iff
query_pos - key_pos < window, the rule torch_native applies.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Finite start for the running max: a row that has seen only masked keys keeps it, and exp2(-inf - NEG_BIG) = 0
# while exp2(NEG_BIG - NEG_BIG) = 1, so such rows never produce inf - inf = NaN.
NEG_BIG = tl.constexpr(-1.0e30)
MIN_DOT = 16  # tl.dot needs every operand dimension >= 16
# The interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bfloat16 dot operands as their raw uint16 bits
# (triton-lang/triton#11584), so there they are upcast first: exact, as bf16 x bf16 products are exact in float32
# and the GPU's MMA accumulates them in float32 too.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
DECODE_BLOCK_H = 16  # query heads of one KV head per decode program (GQA: K/V read once for the group)
DECODE_BLOCK_N = 32  # keys per decode step: small, as decode is bound by reading K/V, not by the dot


@triton.jit
def _dot(a, b):
    """a @ b accumulated in float32; full float32 precision for float32 inputs (not TF32)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _kv_offsets(kv_indices, kv_start, offs_n, key_ok, kv_head, stride_kt, stride_kh, offs_d):
    """Offsets [BLOCK_N, BLOCK_D] into the K (and V) buffer of positions offs_n, through the request's slots."""
    slots = tl.load(kv_indices + kv_start + offs_n, mask=key_ok, other=0).to(tl.int64)
    return slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]


@triton.jit
def _softmax_step(q, K, V, kv_offsets, kv_mask, allowed, m_i, l_i, acc, scale_log2):
    """Fold one block of keys into the running (max, sum, accumulator) of every query row. V is loaded after
    the scores, so K and V are not both held in registers."""
    k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k)) * scale_log2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(Q, K, V, MidO, MidLse, kv_indptr, kv_indices, scale_log2, window,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_mb, stride_mh, stride_ms,
                         stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """Stage 1: one request, up to BLOCK_H query heads of one KV head, one split of the visible keys.
    Writes the split's normalized output and its log2-sum-exp; an empty split writes 0 and -inf."""
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_kv: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = head_block // blocks_per_kv
    g = (head_block % blocks_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = g < GROUP
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    kv_start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - kv_start
    lo = 0
    if SLIDING:  # the one query sits at seq_len - 1: keys before seq_len - window are out of its window
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        offsets = _kv_offsets(kv_indices, kv_start, offs_n, key_ok, kv_head, stride_kt, stride_kh, offs_d)
        m_i, l_i, acc = _softmax_step(q, K, V, offsets, key_ok[:, None] & d_ok[None, :], key_ok[None, :], m_i, l_i,
                                      acc, scale_log2)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    base = b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(MidO + base[:, None] + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


@triton.jit
def _decode_merge_kernel(MidO, MidLse, Out, num_splits, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Stage 2: softmax over the union of a head's splits, weighting each split's output by exp2 of its lse."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds keys, so the max is finite
    parts = tl.load(MidO + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(Out + b * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _extend_kernel(Q, K, V, Out, qo_indptr, kv_indptr, kv_indices, scale_log2, window,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """One request, one query head, BLOCK_M of its new queries, over every key they may see (causal, window).
    The new tokens' K/V are already in the pool, so prefix and new keys come through the same slot list."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qo_indptr + b)
    extend_len = tl.load(qo_indptr + b + 1) - q_start
    if m_block * BLOCK_M < extend_len:
        kv_start = tl.load(kv_indptr + b)
        prefix_len = tl.load(kv_indptr + b + 1) - kv_start - extend_len
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < extend_len
        q_pos = prefix_len + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        # Keys up to the block's last query; with a window, none before its first query's window.
        hi = prefix_len + tl.minimum((m_block + 1) * BLOCK_M, extend_len)
        lo = 0
        if SLIDING:
            lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            key_ok = offs_n < hi
            offsets = _kv_offsets(kv_indices, kv_start, offs_n, key_ok, kv_head, stride_kt, stride_kh, offs_d)
            allowed = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if SLIDING:
                allowed = allowed & (q_pos[:, None] - offs_n[None, :] < window)
            m_i, l_i, acc = _softmax_step(q, K, V, offsets, key_ok[:, None] & d_ok[None, :], allowed, m_i, l_i,
                                          acc, scale_log2)
        out = acc / tl.where(m_ok, l_i, 1.0)[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _block_d(head_dim: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def decode_split_config(group: int, head_dim: int, sliding: bool) -> dict:
    """Compile-time parameters and launch shape of the decode stage-1 kernel (also what the compile test builds)."""
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_H=DECODE_BLOCK_H,
                BLOCK_N=DECODE_BLOCK_N, SLIDING=sliding, num_warps=4, num_stages=2)


def decode_merge_config(head_dim: int, num_splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_S=triton.next_power_of_2(num_splits),
                num_warps=4, num_stages=1)


def extend_config(group: int, head_dim: int, sliding: bool, block_m: int = 64, block_n: int = 64) -> dict:
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
                SLIDING=sliding, num_warps=4 if head_dim <= 64 else 8, num_stages=1)


def _check_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> int:
    """The query-head group size; the kernels index the last dim unit-stride and share K's strides for V."""
    assert q.stride(-1) == 1 and k_buffer.is_contiguous() and v_buffer.is_contiguous()
    assert k_buffer.shape == v_buffer.shape and q.shape[-1] == k_buffer.shape[-1]
    assert q.shape[1] % k_buffer.shape[1] == 0, "query heads must be a multiple of KV heads"
    return q.shape[1] // k_buffer.shape[1]


def _window_args(sliding_window: int | None) -> tuple[int, bool]:
    """(window, SLIDING): the window test is compiled in only for layers that have a window."""
    return (sliding_window or 0), sliding_window is not None


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, scale: float, sliding_window: int | None,
                     num_splits: int) -> torch.Tensor:
    """q [B, H, D], one query per request at its last position; returns [B, H, D] in q's dtype.

    Each request's keys are cut into num_splits pieces so a small batch with long contexts still fills the
    GPU; splits past a short request's keys are empty and drop out of the merge."""
    group = _check_layout(q, k_buffer, v_buffer)
    batch, num_heads, head_dim = q.shape
    window, sliding = _window_args(sliding_window)
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    head_blocks = k_buffer.shape[1] * triton.cdiv(group, DECODE_BLOCK_H)
    _decode_split_kernel[(batch, head_blocks, num_splits)](
        q, k_buffer, v_buffer, mid_o, mid_lse, kv_indptr, kv_indices, scale * LOG2E, window,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        **decode_split_config(group, head_dim, sliding),
    )
    out = q.new_empty(q.shape)
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, num_splits, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), **decode_merge_config(head_dim, num_splits),
    )
    return out


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_extend: int, scale: float,
                     sliding_window: int | None, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q [T, H, D], the packed new tokens of every request; returns [T, H, D] in q's dtype. The new tokens'
    K/V must already be in the pool."""
    group = _check_layout(q, k_buffer, v_buffer)
    num_heads, head_dim = q.shape[1:]
    window, sliding = _window_args(sliding_window)
    out = q.new_empty(q.shape)
    grid = (kv_indptr.numel() - 1, num_heads, math.ceil(max_extend / block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices, scale * LOG2E, window,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), out.stride(0), out.stride(1),
        **extend_config(group, head_dim, sliding, block_m, block_n),
    )
    return out
