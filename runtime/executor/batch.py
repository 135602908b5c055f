"""A batch the scheduler hands to the model runner: which requests, and which of their tokens to compute.

Prefill chunks and decode steps are the same thing here, a slice of a request's fill_ids: decode is a slice of
one token. So one builder serves prefill, decode and mixed batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..attention.base import ForwardBatch
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..wire.messages import ImagePiece, ImageSpan


class BatchRequest(Protocol):
    """What laying out and running a batch reads of a request (the scheduler's Req): its ids, its slot in the
    request table and how many of its tokens have K/V, its images and positions, and the logprobs it asks for."""

    input_ids: list[int]
    req_pool_idx: int | None
    kv_len: int
    images: list[ImageSpan]
    return_logprob: bool
    top_logprobs_num: int

    @property
    def fill_ids(self) -> list[int]: ...

    @property
    def prompt_ids(self) -> list[int]: ...

    def input_logprob_rows(self, start: int, length: int) -> range: ...

    def positions(self, start: int, length: int) -> torch.Tensor: ...


def placeholder(req: BatchRequest) -> int:
    """The input id standing for a request's token still being sampled by a launched batch (the overlap loop's
    token table, scheduler/future_tokens.py, holds it by request slot; negative: never a real id)."""
    return -(req.req_pool_idx + 1)


@dataclass
class ReqSlice:
    req: BatchRequest
    start: int  # first position of fill_ids computed in this forward (== req.kv_len before it)
    length: int
    samples: bool  # the slice reaches the end of fill_ids, so its last row gives the next token
    input_rows: range  # positions whose logits give reported prompt logprobs
    # Speculative decoding: tokens guessed to follow fill_ids, computed after the slice's own (and counted in
    # length) so one forward verifies them; their KV slots are freed again where they are rejected.
    draft: list[int] = field(default_factory=list)

    @classmethod
    def next_of(cls, req: BatchRequest, max_length: int | None = None, unseen: int = 0) -> ReqSlice:
        """The next slice of a request: the rest of its fill_ids, cut at max_length. `unseen`: its tokens still
        being sampled by a launched batch (overlap loop), laid out as placeholders."""
        remaining = len(req.fill_ids) + unseen - req.kv_len
        length = remaining if max_length is None else min(remaining, max_length)
        return cls(req, req.kv_len, length, length == remaining, req.input_logprob_rows(req.kv_len, length))

    @property
    def logit_rows(self) -> range:
        """Positions whose logits are needed; contiguous, since prompt rows end where the sampling row starts."""
        end = self.start + self.length
        if self.input_rows:
            return range(self.input_rows.start, end if self.samples else self.input_rows.stop)
        return range(end - 1 - len(self.draft), end) if self.samples else range(0)


@dataclass
class ScheduleBatch:
    slices: list[ReqSlice]
    forward: ForwardBatch
    logit_ranges: list[range]  # per slice, rows of the packed tokens whose logits are computed

    @property
    def reqs(self) -> list[BatchRequest]:
        return [s.req for s in self.slices]

    @property
    def num_tokens(self) -> int:
        return int(self.forward.extend_lens.sum())


def build_batch(slices: list[ReqSlice], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool,
                alloc: Callable[[int], torch.Tensor]) -> ScheduleBatch:
    """Allocate KV slots for every slice's new tokens, record them in the table, and lay out the forward."""
    lengths = [s.length for s in slices]
    slots = alloc(sum(lengths))
    input_ids: list[int] = []
    logit_ranges: list[range] = []
    images: list[ImagePiece] = []
    offset = 0
    for piece in slices:
        req = piece.req
        end = piece.start + piece.length
        images += image_pieces(req, piece.start, end, offset)
        tokens = req.fill_ids[piece.start : end - len(piece.draft)] + piece.draft
        if len(tokens) < piece.length:  # the last token is still being sampled: read it from the token table
            tokens.append(placeholder(req))
        input_ids.extend(tokens)
        req_pool.req_to_token[req.req_pool_idx, piece.start : end] = slots[offset : offset + piece.length]
        rows = piece.logit_rows
        shift = offset - piece.start
        logit_ranges.append(range(rows.start + shift, rows.stop + shift) if rows else range(0))
        req.kv_len = end
        offset += piece.length
    host = dict(dtype=torch.long, device="cpu")
    starts = torch.tensor([s.start for s in slices], **host)
    extend_lens = torch.tensor(lengths, **host)
    device = kv_pool.device
    forward = ForwardBatch(
        input_ids=to_device(torch.tensor(input_ids, **host), device),
        positions=to_device(batch_positions(slices), device),
        out_cache_loc=to_device(slots, device),
        req_pool_indices=torch.tensor([s.req.req_pool_idx for s in slices], **host),
        prefix_lens=starts,
        extend_lens=extend_lens,
        seq_lens=starts + extend_lens,
        context_lens=torch.tensor([max(s.start + s.length, len(s.req.input_ids)) for s in slices], **host),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        images=images,
    )
    return ScheduleBatch(slices, forward, logit_ranges)


def batch_positions(slices: list[ReqSlice]) -> torch.Tensor:
    """Every slice's rotary positions: [T], or [3, T] when some slice shows an image to an M-RoPE model (then the
    one-axis positions of the others are the same on all three)."""
    parts = [s.req.positions(s.start, s.length) for s in slices]
    if all(part.dim() == 1 for part in parts):
        return torch.cat(parts)
    return torch.cat([part.expand(3, -1) for part in parts], dim=1)


def image_pieces(req: BatchRequest, start: int, end: int, offset: int) -> list[ImagePiece]:
    """The parts of req's images among its positions [start, end), packed from row `offset` on."""
    pieces = []
    for image in req.images:
        first, last = max(image.offset, start), min(image.end, end)
        if first < last:
            pieces.append(ImagePiece(image, range(offset + first - start, offset + last - start),
                                     range(first - image.offset, last - image.offset)))
    return pieces


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; from pinned memory and without waiting, when that is a GPU."""
    if values.device == device:
        return values
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)

