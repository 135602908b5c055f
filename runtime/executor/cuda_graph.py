"""The decode batch sizes CUDA graphs are captured for, and padding a decode batch up to one of them.

A captured graph replays fixed shapes, so a decode batch of n requests runs the graph of the smallest captured
size >= n, with padding rows whose outputs are dropped; above the largest size the batch runs eagerly. Capturing
and replaying are the GPU path's; this module is the shape logic, which runs anywhere.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from ..attention.base import ForwardBatch
from ..config import EngineArgs

# Largest captured batch unless cuda_graph_max_bs says otherwise (SGLang's default on large GPUs).
DEFAULT_MAX_BS = 256


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_bs; max_bs itself too when it falls between rungs, so a batch of
    exactly the largest size that can occur is never left to run eagerly."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


def capture_batch_sizes(args: EngineArgs) -> list[int]:
    """The sizes to capture; none off CUDA or with graphs disabled. No batch exceeds max_running_requests."""
    if args.disable_cuda_graph or not args.device.startswith("cuda"):
        return []
    return batch_size_ladder(min(args.max_running_requests, args.cuda_graph_max_bs or DEFAULT_MAX_BS))


def padded_batch_size(sizes: list[int], n: int) -> int | None:
    """The captured size a batch of n runs at; None (run eagerly) above the largest or with nothing captured."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_decode_batch(batch: ForwardBatch, size: int) -> ForwardBatch:
    """The decode batch grown to `size` requests. Each padding row is a one-token request at position 0 whose K/V
    goes to KV slot 0, which the pool never hands out, so it overwrites nothing live. Its req_pool_indices is
    row 0: it reads one table entry, whatever that holds, and its output is dropped."""
    real = batch.batch_size
    if int(batch.extend_lens.max()) != 1:
        raise ValueError("only decode batches (one new token per request) are padded for CUDA graphs")
    if size < real:
        raise ValueError(f"cannot pad a batch of {real} requests to {size}")
    extra = size - real

    def pad(values: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([values, values.new_full((extra,), fill)])

    padded = dataclasses.replace(
        batch,
        input_ids=pad(batch.input_ids, 0),
        positions=pad(batch.positions, 0),
        out_cache_loc=pad(batch.out_cache_loc, 0),
        req_pool_indices=pad(batch.req_pool_indices, 0),
        prefix_lens=pad(batch.prefix_lens, 0),
        extend_lens=pad(batch.extend_lens, 1),
        seq_lens=pad(batch.seq_lens, 1),
        # Planned for the unpadded shape: the backend plans again for the padded one.
        attn_metadata=None,
        tp_table=None,
    )
    return padded
