"""The paged-KV layout FlashInfer's batch wrappers plan over, computed from a ForwardBatch in plain torch.

FlashInfer describes a batch in CSR form (docs.flashinfer.ai, BatchPrefillWithPagedKVCacheWrapper.plan and
BatchDecodeWithPagedKVCacheWrapper.plan):
- qo_indptr [B+1]: request b's new tokens (queries) are rows qo_indptr[b] .. qo_indptr[b+1] of the packed batch;
- kv_indptr [B+1]: request b's pages are kv_indices[kv_indptr[b] .. kv_indptr[b+1]] (a prefix sum of page counts);
- kv_indices: the page ids, request after request, in position order;
- kv_last_page_len [B]: tokens used in each request's last page, 1 .. page_size.
The prefill wrapper takes all four; the decode wrapper all but qo_indptr. Causality in FlashInfer's prefill aligns
a request's last query with its last key, which is our layout: new tokens are the last extend_lens of seq_lens.

With page size P, KV slot s is offset s % P of page s // P, so a request's table row must hold whole pages:
position i at slot page[i // P] * P + i % P. The torch-native pools hand out single slots (P = 1); a paged
allocator is the GPU path's to add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ForwardBatch


@dataclass
class PagedKVPlan:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [total pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    page_size: int


def indptr(counts: torch.Tensor) -> torch.Tensor:
    """[0, c0, c0+c1, ...] as int32, the index type FlashInfer's plan takes."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = torch.cumsum(counts, 0)
    return out


def plan_paged_kv(batch: ForwardBatch, page_size: int = 1) -> PagedKVPlan:
    """Every request's whole KV (cached prefix and new tokens, seq_lens[b] positions) as pages."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seq_lens = batch.seq_lens
    num_pages = (seq_lens + page_size - 1) // page_size
    max_len = int(seq_lens.max())
    rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :max_len]
    # A page's id is its first slot // P; strided columns are the first position of each page.
    pages = rows[:, ::page_size] // page_size
    used = torch.arange(pages.shape[1], device=pages.device)[None, :] < num_pages[:, None]
    return PagedKVPlan(
        qo_indptr=indptr(batch.extend_lens),
        kv_indptr=indptr(num_pages),
        kv_indices=pages[used].to(torch.int32),  # boolean indexing is row-major: request after request
        kv_last_page_len=((seq_lens - 1) % page_size + 1).to(torch.int32),
        page_size=page_size,
    )
