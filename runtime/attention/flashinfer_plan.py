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

The indptr arrays and last-page lengths come from the batch's lengths, which the scheduler builds on the host:
they stay there, where FlashInfer's plan reads them; the page ids come from the request table, on its device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .base import ForwardBatch
from .cascade import shared_prefix_len


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
    used = torch.arange(pages.shape[1], device=pages.device)[None, :] < num_pages.to(pages.device)[:, None]
    return PagedKVPlan(
        qo_indptr=indptr(batch.extend_lens),
        kv_indptr=indptr(num_pages),
        kv_indices=pages[used].to(torch.int32),  # boolean indexing is row-major: request after request
        kv_last_page_len=((seq_lens - 1) % page_size + 1).to(torch.int32),
        page_size=page_size,
    )


def token_rows(extend_lens: torch.Tensor, reqs: torch.Tensor) -> torch.Tensor:
    """Rows of the packed batch holding the new tokens of requests `reqs`, request after request in that order."""
    lens = extend_lens[reqs]
    owner = torch.repeat_interleave(torch.arange(len(reqs)), lens)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[owner]
    return (torch.cumsum(extend_lens, 0) - extend_lens)[reqs][owner] + offset


def select_requests(batch: ForwardBatch, reqs: torch.Tensor) -> ForwardBatch:
    """The batch of requests `reqs` alone (their lengths and table rows; the per-token fields are left out)."""
    return dataclasses.replace(batch, req_pool_indices=batch.req_pool_indices[reqs],
                               prefix_lens=batch.prefix_lens[reqs], extend_lens=batch.extend_lens[reqs],
                               seq_lens=batch.seq_lens[reqs], attn_metadata=None, tp_table=None)


@dataclass
class CascadePlan:
    """Shared-prefix groups in FlashInfer's two-level cascade layout, page size 1 (the pools' page size).

    The grouped requests' queries, group after group, are the packed-batch rows `tokens`. Level `shared` has one
    entry per group: all its queries over the KV slots every member shares, cached for all of them, so no query
    is masked there. Level `unique` has one entry per request: its queries over its remaining slots, causal (the
    last query aligned with the last key, as in the plain plan). `rest` lists the requests in no group, whose
    queries are the rows `rest_tokens`.
    """

    tokens: torch.Tensor  # [grouped tokens] int64, rows of the packed batch
    shared: PagedKVPlan
    unique: PagedKVPlan
    rest: torch.Tensor  # [requests in no group] int64
    rest_tokens: torch.Tensor


def plan_cascade(batch: ForwardBatch, groups: list[list[int]]) -> CascadePlan | None:
    """The cascade layout of `groups` (torch_native.prefix_groups); None when no group shares any slot."""
    table = batch.req_to_token_pool.req_to_token
    kept, shared_lens, prefixes = [], [], []
    for group in groups:
        rows = table[batch.req_pool_indices[group], : int(batch.seq_lens[group].max())]
        length = shared_prefix_len(rows, batch.prefix_lens[group])
        if length:
            kept.append(group)
            shared_lens.append(length)
            prefixes.append(rows[0, :length])
    if not kept:
        return None
    order = torch.tensor([i for group in kept for i in group])
    rest = torch.tensor(sorted(set(range(batch.batch_size)) - set(order.tolist())), dtype=torch.int64)
    shared_of = torch.tensor([n for group, n in zip(kept, shared_lens) for _ in group])
    seq_lens = batch.seq_lens[order]
    member_rows = table[batch.req_pool_indices[order], : int(seq_lens.max())]
    position = torch.arange(member_rows.shape[1], device=member_rows.device)[None, :]
    own = (position >= shared_of.to(position.device)[:, None]) & (position < seq_lens.to(position.device)[:, None])
    group_queries = torch.tensor([int(batch.extend_lens[group].sum()) for group in kept])
    return CascadePlan(
        tokens=token_rows(batch.extend_lens, order),
        shared=_single_slot_pages(group_queries, torch.cat(prefixes), torch.tensor(shared_lens)),
        unique=_single_slot_pages(batch.extend_lens[order], member_rows[own], seq_lens - shared_of),
        rest=rest,
        rest_tokens=token_rows(batch.extend_lens, rest),
    )


def _single_slot_pages(queries: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> PagedKVPlan:
    """Entries of `queries` rows each over `kv_lens` KV slots (pages of one slot), `slots` entry after entry."""
    return PagedKVPlan(qo_indptr=indptr(queries), kv_indptr=indptr(kv_lens), kv_indices=slots.to(torch.int32),
                       kv_last_page_len=torch.ones(len(kv_lens), dtype=torch.int32), page_size=1)
