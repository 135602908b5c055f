"""Attention over the paged KV pool with torch's scaled_dot_product_attention.

Each request's KV slots are gathered into a padded [B, max_kv_len] block and its new queries into a padded
[B, max_new_len] block; one boolean mask encodes causality (with cached prefixes), padding and sliding windows.
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
        self.causal = key_valid[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])
        self.query_pos = query_pos
        self.key_pos = key_pos
        self.window_masks: dict[int, torch.Tensor] = {}

    def _mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.causal[:, None]
        if sliding_window not in self.window_masks:
            in_window = (self.query_pos[:, :, None] - self.key_pos[None, None, :]) < sliding_window
            # A padded query row may lose every key here; its NaN output is dropped with the padding.
            self.window_masks[sliding_window] = (self.causal & in_window)[:, None]
        return self.window_masks[sliding_window]

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
        bsz, num_heads, head_dim = batch.batch_size, q.shape[1], q.shape[2]
        keys = pool.k_buffer[layer_id][self.kv_index].transpose(1, 2)  # [B, Hkv, max_k, D]
        values = pool.v_buffer[layer_id][self.kv_index].transpose(1, 2)
        if self.max_q == 1:
            queries = q.view(bsz, 1, num_heads, head_dim)
        else:
            queries = q.new_zeros(bsz * self.max_q, num_heads, head_dim)
            queries[self.q_dest] = q
            queries = queries.view(bsz, self.max_q, num_heads, head_dim)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys,
            values,
            attn_mask=self._mask(sliding_window),
            scale=scaling,
            enable_gqa=num_heads != keys.shape[1],
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(bsz * self.max_q, num_heads * head_dim)
        return out if self.max_q == 1 else out[self.q_dest]
