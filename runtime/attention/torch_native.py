"""Attention over the paged KV pool with torch's scaled_dot_product_attention.

Requests whose cached prefixes share their first KV slots (program branches, one system prompt) form a bucket
per shared prefix, which cascade attention reads once for all of them (cascade.py); the others are bucketed by
length (padding a short request to the longest one's length wastes gather and
attention work); in each bucket, KV slots are gathered into a padded [B, max_kv_len] block and new queries into
a padded [B, max_new_len] block, with one boolean mask for causality (with cached prefixes), padding and sliding
windows. Queries are grouped under their KV head (GQA without repeating K/V): the G query heads of a group are
stacked along the query axis, so SDPA sees KV heads as its heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import paged_attention
from . import paged_table
from .base import ForwardBatch, ModelAttention, PlannedForward
from .cascade import MIN_SHARED_TOKENS, attend_with_lse, merge, shared_prefix_len

MAX_BUCKETS = 4
# Each extra bucket costs a few kernel launches per layer; it must save more than this share of padded work.
BUCKET_OVERHEAD = 0.05


@dataclass
class Bucket:
    """Requests attended together: their packed tokens, padded layout and mask."""

    tokens: torch.Tensor  # indices of the bucket's tokens in the packed batch
    q_dest: torch.Tensor  # where each of those tokens sits in the padded [B * max_q] query block
    kv_index: torch.Tensor  # [B, max_k] KV slots; padding points at slot 0, which is never allocated
    causal: torch.Tensor  # [B, max_q, max_k]
    query_pos: torch.Tensor  # [B, max_q]
    max_q: int
    max_k: int
    shared_len: int = 0  # leading KV slots all requests share (cascade attention); see cascade.py
    unmasked: bool = False  # one query per request and no padding: the mask would be all True
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.kv_index.shape[0]

    def to(self, device: torch.device) -> Bucket:
        """The bucket with its index tensors on the device that runs attention (planned on the host)."""
        if device.type == "cpu":
            return self
        return dataclasses.replace(self, tokens=self.tokens.to(device), q_dest=self.q_dest.to(device),
                                   kv_index=self.kv_index.to(device), causal=self.causal.to(device),
                                   query_pos=self.query_pos.to(device), masks={})

    def mask(self, sliding_window: int | None, group: int) -> torch.Tensor | None:
        """[B, 1, group * max_q, max_k]: each request's mask repeated for the query heads of a KV group; None
        where every query sees every key (decode of equal-length requests), which SDPA runs faster unmasked."""
        if self.unmasked and (sliding_window is None or sliding_window >= self.max_k):
            return None
        key = (sliding_window, group)
        if key not in self.masks:
            mask = self.causal
            if sliding_window is not None:
                # A padded query row may lose every key here; its NaN output is dropped with the padding.
                key_pos = torch.arange(self.max_k, device=self.query_pos.device)
                mask = mask & ((self.query_pos[:, :, None] - key_pos[None, None, :]) < sliding_window)
            self.masks[key] = mask.repeat(1, group, 1)[:, None]
        return self.masks[key]


def prefix_groups(batch: ForwardBatch) -> list[list[int]]:
    """Requests (two or more) whose cached prefixes start with the same MIN_SHARED_TOKENS KV slots: each group
    becomes its own bucket, where cascade attention reads the shared slots once for all its queries."""
    candidates = (batch.prefix_lens >= MIN_SHARED_TOKENS).nonzero().flatten()
    if len(candidates) < 2:
        return []
    heads = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[candidates], :MIN_SHARED_TOKENS]
    _, group_of = torch.unique(heads, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for request, group in zip(candidates.tolist(), group_of.tolist()):
        groups.setdefault(group, []).append(request)
    return [members for members in groups.values() if len(members) > 1]


def plan_all_buckets(batch: ForwardBatch) -> list[list[int]]:
    """Prefix-sharing groups first (one bucket each), the other requests bucketed by length."""
    seq_lens, extend_lens = batch.seq_lens.tolist(), batch.extend_lens.tolist()
    sharing = prefix_groups(batch)
    grouped = {i for members in sharing for i in members}
    rest = [i for i in range(len(seq_lens)) if i not in grouped]
    if not rest:
        return sharing
    planned = plan_buckets([seq_lens[i] for i in rest], [extend_lens[i] for i in rest])
    return sharing + [[rest[j] for j in bucket] for bucket in planned]


def plan_buckets(seq_lens: list[int], extend_lens: list[int]) -> list[list[int]]:
    """Split requests, ranked by length, into the number of equal-count buckets that minimizes padded work."""
    order = sorted(range(len(seq_lens)), key=lambda i: (seq_lens[i], extend_lens[i]))

    def padded_work(groups: list[list[int]]) -> float:
        return sum(len(g) * max(seq_lens[i] for i in g) * max(extend_lens[i] for i in g) for g in groups)

    best, best_cost = [order], float("inf")
    for count in range(1, min(MAX_BUCKETS, len(order)) + 1):
        size = -(-len(order) // count)
        # Within a bucket, batch order: a single bucket then needs no reordering of the packed tokens.
        groups = [sorted(order[i : i + size]) for i in range(0, len(order), size)]
        cost = padded_work(groups) * (1 + BUCKET_OVERHEAD * (len(groups) - 1))
        if cost < best_cost:
            best, best_cost = groups, cost
    return best


class TorchNativeAttention(PlannedForward):
    """On a CPU, the batches of a model paged_attention serves read the KV pool through its kernel (no gather,
    no padding); the others are bucketed as the module's docstring says."""

    uses_model = True  # select.make_attention_backend passes the model's attention shape

    def __init__(self, model: ModelAttention | None = None) -> None:
        self.buckets: list[Bucket] = []
        self.table: paged_table.PagedTable | None = None
        self.paged = paged_table.serves(model)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if self.paged and batch.device.type == "cpu":
            batch.attn_metadata = paged_table.paged_table(batch)
            return
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        groups = plan_all_buckets(batch)
        batch.attn_metadata = [self._bucket(batch, torch.tensor(g, device="cpu"), starts).to(batch.device)
                               for g in groups]

    def begin_forward(self, batch: ForwardBatch) -> None:
        super().begin_forward(batch)
        self.table = self.metadata if isinstance(self.metadata, paged_table.PagedTable) else None
        self.buckets = [] if self.table is not None else self.metadata

    @staticmethod
    def _bucket(batch: ForwardBatch, reqs: torch.Tensor, starts: torch.Tensor) -> Bucket:
        extend_lens, seq_lens, prefix_lens = batch.extend_lens[reqs], batch.seq_lens[reqs], batch.prefix_lens[reqs]
        max_q, max_k = int(extend_lens.max()), int(seq_lens.max())
        local_req = torch.repeat_interleave(torch.arange(len(reqs), device="cpu"), extend_lens)
        request_starts = torch.cumsum(extend_lens, 0) - extend_lens
        offset = torch.arange(int(extend_lens.sum()), device="cpu") - request_starts[local_req]
        tokens = starts[reqs][local_req] + offset
        key_pos = torch.arange(max_k, device="cpu")
        key_valid = key_pos[None, :] < seq_lens[:, None]
        table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[reqs], :max_k]
        query_pos = prefix_lens[:, None] + torch.arange(max_q, device="cpu")[None, :]
        shared = shared_prefix_len(table, prefix_lens)
        return Bucket(
            tokens=tokens,
            q_dest=local_req * max_q + offset,
            kv_index=torch.where(key_valid, table, torch.zeros_like(table)),
            causal=key_valid[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None]),
            query_pos=query_pos,
            max_q=max_q,
            max_k=max_k,
            shared_len=shared,
            unmasked=max_q == 1 and bool((seq_lens == max_k).all()),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
        logit_cap: float | None = None,
    ) -> torch.Tensor:
        batch = self.batch
        batch.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if self.table is not None:
            pool = batch.token_to_kv_pool
            out = paged_attention.attention(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                                            self.table.kv_index, self.table.spans, scaling)
            return out.view(q.shape[0], -1)
        if len(self.buckets) == 1:
            return self._attend(self.buckets[0], q, layer_id, scaling, sliding_window, logit_cap)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for bucket in self.buckets:
            out[bucket.tokens] = self._attend(bucket, q[bucket.tokens], layer_id, scaling, sliding_window, logit_cap)
        return out

    def _attend(self, bucket: Bucket, q: torch.Tensor, layer_id: int, scaling: float,
                sliding_window: int | None, logit_cap: float | None) -> torch.Tensor:
        """q: the bucket's packed queries [T, H, D]; returns [T, H * D]."""
        pool = self.batch.token_to_kv_pool
        bsz, max_q, num_heads, head_dim = bucket.size, bucket.max_q, q.shape[1], q.shape[2]
        num_kv_heads = pool.k_buffer[layer_id].shape[1]
        group = num_heads // num_kv_heads
        if max_q > 1:
            padded = q.new_zeros(bsz * max_q, num_heads, head_dim)
            padded[bucket.q_dest] = q
            q = padded
        # [B*max_q, Hkv*G, D] -> [B, Hkv, G*max_q, D]
        grouped = q.view(bsz, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(bsz, num_kv_heads, group * max_q, head_dim)
        if bucket.shared_len and sliding_window is None and logit_cap is None:
            out = self._attend_cascade(bucket, grouped, layer_id, scaling, group)
        else:
            keys, values = pool.gather(layer_id, bucket.kv_index)  # [B, max_k, Hkv, D]
            attend = F.scaled_dot_product_attention if logit_cap is None else soft_capped_attention(logit_cap)
            out = attend(grouped, keys.transpose(1, 2), values.transpose(1, 2),
                         attn_mask=bucket.mask(sliding_window, group), scale=scaling)
        out = out.view(bsz, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bsz * max_q, num_heads * head_dim)
        return out if max_q == 1 else out[bucket.q_dest]

    def _attend_cascade(self, bucket: Bucket, grouped: torch.Tensor, layer_id: int, scaling: float,
                        group: int) -> torch.Tensor:
        """grouped [B, Hkv, G*max_q, D]: the shared prefix once for every query, each suffix on its own."""
        pool, shared = self.batch.token_to_kv_pool, bucket.shared_len
        bsz, num_kv_heads, rows, head_dim = grouped.shape
        prefix_k, prefix_v = pool.gather(layer_id, bucket.kv_index[:1, :shared])  # [1, P, Hkv, D]
        every_query = grouped.transpose(0, 1).reshape(num_kv_heads, bsz * rows, head_dim)
        out_prefix, lse_prefix = attend_with_lse(every_query, prefix_k[0].transpose(0, 1),
                                                 prefix_v[0].transpose(0, 1), scaling)
        out_prefix = out_prefix.view(num_kv_heads, bsz, rows, head_dim).transpose(0, 1)
        lse_prefix = lse_prefix.view(num_kv_heads, bsz, rows, 1).transpose(0, 1)
        suffix_k, suffix_v = pool.gather(layer_id, bucket.kv_index[:, shared:])  # [B, max_k - P, Hkv, D]
        mask = bucket.mask(None, group)
        suffix_mask = None if mask is None else mask[..., shared:]
        out_suffix, lse_suffix = attend_with_lse(grouped, suffix_k.transpose(1, 2), suffix_v.transpose(1, 2),
                                                 scaling, suffix_mask)
        return merge(out_prefix, lse_prefix, out_suffix, lse_suffix)


def soft_capped_attention(cap: float) -> Callable[..., torch.Tensor]:
    """SDPA's signature for attention whose scores are soft-capped, cap * tanh(s / cap), before the mask (Gemma 2;
    SDPA has no such hook). The arithmetic order of HF's eager Gemma 2 attention; softmax in float32."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    return attend
