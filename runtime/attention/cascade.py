"""Shared-prefix (cascade) attention: a bucket whose requests all start with the same cached KV slots attends
to that prefix once for all their queries, then to each request's own suffix, and merges the two partial
results by their log-sum-exp. Exact up to float rounding: softmax over the union of two key sets.

Program branches (fork children, the choices of a select, a batch behind one preamble) are exactly such
buckets; without this, every request gathers its own copy of the shared prefix's K/V in every layer.
"""

from __future__ import annotations

import torch

# Below this many shared slots, the separate pass costs more than the gathers it saves.
MIN_SHARED_TOKENS = 64


def shared_prefix_len(table: torch.Tensor, prefix_lens: torch.Tensor) -> int:
    """Leading KV slots identical in every row of `table` [B, L] and cached for every request (so every query
    of the bucket sees all of them); 0 when fewer than two requests or MIN_SHARED_TOKENS slots."""
    if table.shape[0] < 2:
        return 0
    limit = min(int(prefix_lens.min()), table.shape[1])
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    shared = int(same.int().cumprod(0).sum()) if limit else 0
    return shared if shared >= MIN_SHARED_TOKENS else 0


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each query row's log-sum-exp. q [..., Nq, D], k and v [..., Nk, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Combine attention over two disjoint key sets into attention over their union."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * weight_a + out_b * weight_b) / (weight_a + weight_b)
