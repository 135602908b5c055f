"""What rank 0 hands the followers for each forward: a small header over each follower's pipe, then one int64
tensor broadcast over the group that carries the batch layout, the logit rows and the request-table entries.

Followers keep their own ReqToTokenPool; rank 0 sends each request's entries [0, seq_len) every step rather than
only the new ones, because the radix cache rewrites table rows (prefix matches, de-duplicated inserts) without a
forward. The entries are snapshotted on the scheduler thread (snapshot_table), where the attention metadata is
built, since with the overlap loop the scheduler edits the table while the forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..attention.base import ForwardBatch
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool


@dataclass(frozen=True)
class StepHeader:
    """Sizes of the packed tensor's parts (the followers allocate it before the broadcast fills it)."""

    tokens: int
    requests: int
    logit_rows: int
    table_entries: int

    @property
    def sizes(self) -> list[int]:
        # input_ids, positions, out_cache_loc; req_pool_indices, prefix_lens, extend_lens, seq_lens, context_lens;
        # rows; table.
        return [self.tokens] * 3 + [self.requests] * 5 + [self.logit_rows, self.table_entries]


def _used(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] mask of the table entries each request uses."""
    return torch.arange(width, device=seq_lens.device)[None, :] < seq_lens[:, None]


def snapshot_table(forward: ForwardBatch) -> None:
    """Copy (into forward.tp_table) the table entries the batch's requests use, concatenated request by request."""
    width = int(forward.seq_lens.max())
    rows = forward.req_to_token_pool.req_to_token[forward.req_pool_indices, :width]
    forward.tp_table = rows[_used(forward.seq_lens, width)]


def send_step(forward: ForwardBatch, logit_rows: torch.Tensor, pipes: list[Connection], device: str) -> None:
    """Rank 0: tell every follower the sizes, then broadcast the packed step (from `device`: NCCL needs it there)."""
    parts = [forward.input_ids, forward.positions, forward.out_cache_loc, forward.req_pool_indices,
             forward.prefix_lens, forward.extend_lens, forward.seq_lens, forward.rope_context_lens, logit_rows,
             forward.tp_table]
    header = StepHeader(len(forward.input_ids), len(forward.seq_lens), len(logit_rows), len(forward.tp_table))
    for pipe in pipes:
        pipe.send(header)
    dist.broadcast(torch.cat([part.to(device) for part in parts]), src=0)


def receive_step(header: StepHeader, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool,
                 device: str) -> tuple[ForwardBatch, torch.Tensor]:
    """A follower: the broadcast step as a ForwardBatch over this rank's pools (its table rows updated), and the
    rows whose logits rank 0 computes."""
    packed = torch.empty(sum(header.sizes), dtype=torch.long, device=device)
    dist.broadcast(packed, src=0)
    (input_ids, positions, out_cache_loc, *on_host, logit_rows, table) = packed.split(header.sizes)
    # The per-request layout and the table are host bookkeeping, as on rank 0 (attention/base.py).
    req_pool_indices, prefix_lens, extend_lens, seq_lens, context_lens = (part.cpu() for part in on_host)
    table = table.cpu()
    width = int(seq_lens.max())
    rows = req_pool.req_to_token[req_pool_indices, :width]
    rows[_used(seq_lens, width)] = table
    req_pool.req_to_token[req_pool_indices, :width] = rows
    forward = ForwardBatch(input_ids, positions, out_cache_loc, req_pool_indices, prefix_lens, extend_lens, seq_lens,
                           req_pool, kv_pool, context_lens=context_lens)
    return forward, logit_rows
