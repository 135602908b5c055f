"""A batch as the paged attention kernel (kernels/paged_attention.py) reads it, and which models it serves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.paged_attention import spans, supports
from .base import ForwardBatch, ModelAttention


def serves(model: ModelAttention | None) -> bool:
    """Whether every layer of this model can attend through the kernel: full causal attention (no sliding
    window), no soft-capped scores, a shape and dtype it takes."""
    return (model is not None and model.num_kv_heads is not None and model.windows == frozenset({None})
            and model.logit_cap is None and supports(model.num_heads, model.num_kv_heads, model.head_dim,
                                                     model.dtype))


@dataclass
class PagedTable:
    """A batch's requests as the kernel reads them (planned on the scheduler thread)."""

    kv_index: torch.Tensor  # [B, L] int64: row b's first seq_lens[b] entries are its KV slots
    spans: torch.Tensor  # [3, B] int64: each request's first row in the packed tokens, new tokens, cached ones


def paged_table(batch: ForwardBatch) -> PagedTable:
    """The request table's rows of a batch, up to its longest context (a copy: indexing by a tensor)."""
    longest = int(batch.seq_lens.max())
    table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :longest]
    first_rows = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
    return PagedTable(table, spans(first_rows, batch.extend_lens, batch.prefix_lens))
