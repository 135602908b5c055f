"""Attention with Triton kernels (triton_kernels.py): the GPU backend for machines without flashinfer.

init_forward_metadata snapshots each request's KV slots into one flattened plan on the pool's device (the
scheduler may edit the request table while the forward runs), so a layer's forward only writes its new K/V and
launches kernels: no host work, no sync. A batch of one new token per request runs the split-KV decode kernel,
anything else (prefill, extend over a cached prefix, mixed batches) the causal extend kernel.

CUDA graphs (GraphAttentionBackend): a captured decode batch reads its plan from buffers allocated once, and
always runs MAX_KV_SPLITS splits (the kernel cuts each request's keys by its own length, so a fixed count is
correct for any length; a captured grid cannot follow the batch's longest request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ForwardBatch, PlannedForward
from .flashinfer_plan import indptr
from .triton_kernels import decode_attention, extend_attention

# Decode keys per split: below this, another split costs more (a launch slot, a merge row) than it parallelizes.
SPLIT_TOKENS = 128
MAX_KV_SPLITS = 8


@dataclass
class TritonMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32: request b's KV slots are kv_indices[kv_indptr[b] .. kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64: KV slots, request after request, in position order
    decode: bool  # one new token per request
    max_extend: int  # the most new tokens of any request (the extend grid's query blocks)
    num_kv_splits: int  # decode: how many pieces each request's keys are cut into


def num_kv_splits(max_seq_len: int, split_tokens: int = SPLIT_TOKENS, max_splits: int = MAX_KV_SPLITS) -> int:
    """Enough splits that the longest request's keys come in pieces of about split_tokens, at most max_splits."""
    return max(1, min(max_splits, -(-max_seq_len // split_tokens)))


def plan_slots(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """Every request's KV slots (positions 0 .. seq_len-1), request after request: a copy, not a view."""
    table = batch.req_to_token_pool.req_to_token
    max_len = int(batch.seq_lens.max())
    rows = table[batch.req_pool_indices.to(table.device), :max_len]
    used = torch.arange(max_len, device=table.device)[None, :] < batch.seq_lens.to(table.device)[:, None]
    return rows[used].to(device)


@dataclass
class GraphBuffers:
    """The fixed plan buffers every captured decode batch reads (one replay at a time, on the forward thread)."""

    qo_indptr: torch.Tensor  # [max_bs + 1] int32: 0, 1, 2, ... (one query per request)
    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int64


class TritonAttention(PlannedForward):
    def __init__(self, split_tokens: int = SPLIT_TOKENS, max_kv_splits: int = MAX_KV_SPLITS) -> None:
        self.split_tokens = split_tokens
        self.max_kv_splits = max_kv_splits
        self.graph: GraphBuffers | None = None

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: str) -> None:
        self.graph = GraphBuffers(
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * max_context_len, dtype=torch.int64, device=device),
        )

    def init_forward_metadata_graph(self, batch: ForwardBatch) -> None:
        """A decode batch of a captured size, planned into the fixed buffers (their contents, never addresses)."""
        if self.graph is None:
            raise RuntimeError("init_cuda_graph_state must run before a batch is planned for a CUDA graph")
        if int(batch.extend_lens.max()) != 1:
            raise ValueError("CUDA graphs capture decode batches only (one new token per request)")
        bs, graph = batch.batch_size, self.graph
        if bs + 1 > len(graph.kv_indptr):
            raise ValueError(f"decode batch of {bs} exceeds the {len(graph.kv_indptr) - 1} planned for graphs")
        slots = plan_slots(batch, torch.device("cpu"))
        graph.kv_indptr[: bs + 1].copy_(indptr(batch.seq_lens), non_blocking=True)
        graph.kv_indices[: len(slots)].copy_(slots, non_blocking=True)
        batch.attn_metadata = TritonMetadata(
            qo_indptr=graph.qo_indptr[: bs + 1], kv_indptr=graph.kv_indptr[: bs + 1], kv_indices=graph.kv_indices,
            decode=True, max_extend=1, num_kv_splits=self.max_kv_splits,
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.token_to_kv_pool.k_buffer[0].device
        max_extend = int(batch.extend_lens.max())
        batch.attn_metadata = TritonMetadata(
            qo_indptr=indptr(batch.extend_lens).to(device),
            kv_indptr=indptr(batch.seq_lens).to(device),
            kv_indices=plan_slots(batch, device),
            decode=max_extend == 1,
            max_extend=max_extend,
            num_kv_splits=num_kv_splits(int(batch.seq_lens.max()), self.split_tokens, self.max_kv_splits),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        pool, meta = self.batch.token_to_kv_pool, self.metadata
        pool.set_kv(layer_id, self.batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        if meta.decode:
            out = decode_attention(q, k_buffer, v_buffer, meta.kv_indptr, meta.kv_indices, scaling, sliding_window,
                                   meta.num_kv_splits)
        else:
            out = extend_attention(q, k_buffer, v_buffer, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                   meta.max_extend, scaling, sliding_window)
        return out.view(q.shape[0], -1)
