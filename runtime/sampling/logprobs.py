"""Logprobs of chosen tokens and top-k alternatives, computed from raw (unadjusted) model logits."""

from __future__ import annotations

import torch

TopEntries = list[tuple[float, int]]


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[float]:
    """logprobs: [N, V] log-softmax rows; token_ids: [N]."""
    return logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[TopEntries]:
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
