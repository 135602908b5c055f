"""Attention over the paged KV pool with torch's scaled_dot_product_attention.

Each request's KV slots are gathered into a padded [B, max_kv_len] block and its new queries into a padded
[B, max_new_len] block; one boolean mask encodes causality (with cached prefixes), padding and sliding windows.
Queries are grouped under their KV head (GQA without repeating K/V): the G query heads of a group are stacked
along the query axis, so SDPA sees KV heads as its heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ForwardBatch


class TorchNativeAttention:
    def __init__(self) -> None:
        self.batch: ForwardBatch | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.batch = batch
        bsz = batch.batch_size
        self.max_q = int(batch.extend_lens.max())
        self.max_k = int(batch.seq_lens.max())
        # Where each packed token sits in the padded [B * max_q] query block.
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        req_of_token = torch.repeat_interleave(torch.arange(bsz), batch.extend_lens)
        offset_in_req = torch.arange(int(batch.extend_lens.sum())) - starts[req_of_token]
        self.q_dest = req_of_token * self.max_q + offset_in_req
        # KV slot of every (request, key position); padding points at slot 0, which is never allocated.
        key_pos = torch.arange(self.max_k)
        key_valid = key_pos[None, :] < batch.seq_lens[:, None]
        table = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, : self.max_k]
        self.kv_index = torch.where(key_valid, table, torch.zeros_like(table))
        query_pos = batch.prefix_lens[:, None] + torch.arange(self.max_q)[None, :]  # [B, max_q]
        self.causal = key_valid[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])  # [B, max_q, max_k]
        self.query_pos = query_pos
        self.key_pos = key_pos
        self.masks: dict[tuple[int | None, int], torch.Tensor] = {}

    def _mask(self, sliding_window: int | None, group: int) -> torch.Tensor:
        """[B, 1, group * max_q, max_k]: the request's mask repeated for each query head of a KV group."""
        key = (sliding_window, group)
        if key not in self.masks:
            mask = self.causal
            if sliding_window is not None:
                # A padded query row may lose every key here; its NaN output is dropped with the padding.
                mask = mask & ((self.query_pos[:, :, None] - self.key_pos[None, None, :]) < sliding_window)
            self.masks[key] = mask.repeat(1, group, 1)[:, None]
        return self.masks[key]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "init_forward_metadata must run before forward"
        pool = batch.token_to_kv_pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        keys, values = pool.gather(layer_id, self.kv_index)  # [B, max_k, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, max_k, D]
        bsz, num_heads, head_dim = batch.batch_size, q.shape[1], q.shape[2]
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        if self.max_q > 1:
            padded = q.new_zeros(bsz * self.max_q, num_heads, head_dim)
            padded[self.q_dest] = q
            q = padded
        # [B*max_q, Hkv*G, D] -> [B, Hkv, G*max_q, D]
        grouped = q.view(bsz, self.max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(bsz, num_kv_heads, group * self.max_q, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self._mask(sliding_window, group),
                                             scale=scaling)
        out = out.view(bsz, num_kv_heads, group, self.max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bsz * self.max_q, num_heads * head_dim)
        return out if self.max_q == 1 else out[self.q_dest]
