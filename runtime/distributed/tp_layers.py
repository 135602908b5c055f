"""Tensor-parallel layers (Megatron style) and how a checkpoint tensor is cut into this rank's shard.

Column-parallel layers (qkv_proj, gate_up_proj) are plain nn.Linear with fewer output rows: each rank computes its
own heads / intermediate columns and needs no communication. Row-parallel layers (o_proj, down_proj) sum partial
products with an all_reduce. The vocabulary is split in equal (padded) ranges for both the embedding and the LM
head. With tp size 1 the factories return the plain torch modules, so the single-process path is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .parallel_state import TensorParallel

# HF projection names by how they are split: by output rows (with their bias) or by input columns.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


class RowParallelLinear(nn.Linear):
    """Input features split across ranks; partial outputs summed. The bias is added once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the (padded) vocabulary; ids of other ranks' rows look up zeros, and the sum over ranks
    is the full lookup (exact: one term is non-zero)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(tp.shard(tp.padded(vocab_size)), hidden_size)
        self.vocab_start = tp.rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        dist.all_reduce(out)
        return out


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary range, gathered from every rank into the full vocabulary (padding cut)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, tp.shard(tp.padded(vocab_size)), bias=False)
        self.vocab_size, self.tp_size = vocab_size, tp.size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    """in_features: the full width; each rank holds its share."""
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(tp.shard(in_features), out_features, bias=bias)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Embedding:
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallel) -> nn.Linear:
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, tp)


def shard_tensor(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of HF checkpoint tensor `name`: the parameter's shape as the TP layers above hold it.
    q/k/v and gate/up are cut each on its own, so the fused qkv_proj / gate_up_proj hold [q_r, k_r, v_r]."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if module in COLUMN_PARALLEL:
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if module in ROW_PARALLEL and kind == "weight":
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    if module in VOCAB_PARALLEL:
        rows = tp.shard(tp.padded(tensor.shape[0]))
        local = tensor[tp.rank * rows : (tp.rank + 1) * rows]
        return F.pad(local, (0, 0, 0, rows - local.shape[0]))  # the last rank's padding rows are zeros
    return tensor


def unshard_tensor(name: str, shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The whole checkpoint tensor `name` from every rank's shard_tensor part, in rank order."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if module in COLUMN_PARALLEL:
        return torch.cat(shards, dim=0)
    if module in ROW_PARALLEL and kind == "weight":
        return torch.cat(shards, dim=1)
    if module in VOCAB_PARALLEL:
        return torch.cat(shards, dim=0)[:vocab_size]  # the last rank's padding rows cut
    return shards[0]
