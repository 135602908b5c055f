"""What every attention backend sees: the layout of one forward batch, and the backend interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..wire.messages import ImagePiece


@dataclass
class ForwardBatch:
    """Tokens of all requests in one forward, packed request after request.

    Request b contributes `extend_lens[b]` new tokens at positions prefix_lens[b] .. seq_lens[b]-1;
    a decode step is the case extend_lens == 1.

    The per-token tensors the model reads are on the KV pool's device; the per-request layout stays on the host,
    beside the request table it indexes: backends plan from it on the host and copy what their kernels read.
    """

    input_ids: torch.Tensor  # [T] device
    positions: torch.Tensor  # [T] device
    out_cache_loc: torch.Tensor  # [T] device: KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [B] host
    prefix_lens: torch.Tensor  # [B] host
    extend_lens: torch.Tensor  # [B] host
    seq_lens: torch.Tensor  # [B] host
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    # Filled by the attention backend's init_forward_metadata, on the scheduler thread, before the forward runs
    # (with the overlap loop the forward runs on a worker while the scheduler edits the request table).
    attn_metadata: Any = None
    # Tensor parallel: the request-table entries followers copy, snapshotted beside attn_metadata for the same reason.
    tp_table: torch.Tensor | None = None
    # Vision-language models: the images this forward's tokens show (their rows' embeddings come from the
    # encoder), and those embeddings, (rows [R] device, values [R, hidden]), once the model runner computed them.
    images: list[ImagePiece] = field(default_factory=list)
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B] host: the context length LongRoPE picks its factors by (Phi-3): a prompt's whole length while it is
    # prefilled in chunks, so every chunk rotates as one whole prefill would. None: seq_lens.
    context_lens: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.token_to_kv_pool.device

    @property
    def rope_context_lens(self) -> torch.Tensor:
        return self.seq_lens if self.context_lens is None else self.context_lens

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def is_decode(self) -> bool:
        return int(self.extend_lens.max()) == 1 and int(self.prefix_lens.min()) > 0


@dataclass(frozen=True)
class ModelAttention:
    """What a backend that plans ahead must know of the model before any layer runs: FlashInfer plans a batch
    (head counts, softmax scale, sliding window, dtypes) in init_forward_metadata, before it sees a query."""

    num_heads: int  # query heads on this rank
    head_dim: int
    scaling: float
    dtype: torch.dtype
    windows: frozenset[int | None] = frozenset({None})  # the layers' sliding windows; None: full attention
    logit_cap: float | None = None  # the layers' attention soft-capping (Gemma 2), None: none
    num_kv_heads: int | None = None  # KV heads on this rank; None: not told


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into the pool, then attends each new query over its request's whole KV."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute what every layer needs into batch.attn_metadata, so per-layer calls only index it."""

    def begin_forward(self, batch: ForwardBatch) -> None:
        """The batch whose layers run next (set on the thread that runs the forward)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
        logit_cap: float | None = None,  # tanh soft-capping of the scores (Gemma 2); passed only when set
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...


class PlannedForward:
    """begin_forward as every backend does it: hold the batch whose layers run next and the metadata
    init_forward_metadata planned for it, which the per-layer forward calls read (on the forward thread, while the
    scheduler thread may already plan the next batch)."""

    batch: ForwardBatch | None = None
    metadata: Any = None

    def begin_forward(self, batch: ForwardBatch) -> None:
        assert batch.attn_metadata is not None, "init_forward_metadata must run before the forward"
        self.batch = batch
        self.metadata = batch.attn_metadata


class GraphAttentionBackend(AttentionBackend, Protocol):
    """A backend whose decode forward can be captured in a CUDA graph (runtime/executor/cuda_graph_runner.py).

    A graph replays the kernels it captured with the tensors it captured, so for decode batches of a captured
    size the backend keeps its metadata in buffers allocated once per size: each replay rewrites their contents,
    never their addresses. Such a batch skips init_forward_metadata: init_forward_metadata_graph plans it into the
    fixed buffers on the forward thread, in stream order after the previous batch, so the overlap loop never
    rewrites a buffer a queued replay reads.
    """

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: str) -> None:
        """Allocate the fixed metadata buffers for decode batches of up to max_bs requests."""

    def init_forward_metadata_graph(self, batch: ForwardBatch) -> None:
        """On the forward thread, just before capture and before each replay of a decode batch of a captured size:
        plan it into the fixed buffers and point batch.attn_metadata at metadata that reads them. Every batch of a
        size shares the buffers, so planning ahead (as init_forward_metadata does under the overlap loop) would
        rewrite them under a replay still queued."""
