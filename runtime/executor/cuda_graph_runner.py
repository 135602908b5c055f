"""CUDA graphs for decode: the model's forward and logits captured once per batch size, replayed for each step.

A decode step of a small batch is dozens of short kernels per layer; launching them one by one from Python costs
more than running them. A captured graph launches them all at once. Each graph replays the exact tensors it was
captured with, so its inputs are fixed buffers: a batch is padded to the next captured size (cuda_graph.py) on the
scheduler thread; on the forward thread the token ids, positions and KV slots are copied into the fixed buffers,
the backend plans the batch into its fixed per-size buffers (GraphAttentionBackend), and the graph replays. All
of it in stream order after the previous batch's kernels, so the overlap loop never rewrites a buffer a queued
replay reads. Planning there reads the request table while the scheduler thread edits it; the rows it reads are
the batch's own, whose entries up to their lengths stay put, except a request that finished while the batch was
in flight: its row may be handed to a new request meanwhile, and its output (already dropped) is garbage.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..attention.base import ForwardBatch, GraphAttentionBackend
from ..cache.memory_pool import ReqToTokenPool, TokenToKVPool
from ..config import EngineArgs
from .cuda_graph import capture_batch_sizes, pad_decode_batch, padded_batch_size

logger = logging.getLogger("furcate.cuda_graph")


def one_token_each(forward: ForwardBatch) -> bool:
    """A decode-shaped batch: one new token per request (a one-token prompt is one too, with no prefix). Not one
    whose token shows an image (a prompt's last token, say): its row takes the encoder's embedding, and an M-RoPE
    model its three-axis position, neither of which a captured graph reads."""
    return int(forward.extend_lens.max()) == 1 and not forward.images


# Why neither a CUDA graph nor a compiled CPU step captures a MoE model's decode.
MOE_REASON = ("its mixture-of-experts layers group tokens by expert in sizes known only at run time (the expert "
              "loop reads them on the host)")


def capturable(model) -> str | None:
    """Why the model's decode cannot be captured in a CUDA graph, or None. LongRoPE picks each request's
    factors from its length on the host, which a replay would not redo."""
    if model.family.moe is not None:
        return MOE_REASON
    if model.model.rotary.long_after is not None:
        return "its LongRoPE factors depend on each request's length"
    return None


def supports_cuda_graphs(backend) -> bool:
    return hasattr(backend, "init_cuda_graph_state") and hasattr(backend, "init_forward_metadata_graph")


class CudaGraphRunner:
    """Captures the decode forward for every size in `sizes` at start-up; pads and replays decode batches."""

    def __init__(self, model, backend: GraphAttentionBackend, sizes: list[int], req_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool, device: str) -> None:
        self.model, self.backend, self.sizes = model, backend, sizes
        self.req_pool, self.kv_pool = req_pool, kv_pool
        max_bs = sizes[-1]
        self.device = torch.device(device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        backend.init_cuda_graph_state(max_bs, req_pool.req_to_token.shape[1], device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.calls = 0  # forwards that replayed a graph
        # Largest first: smaller graphs then fit in the memory the largest one's pool already holds.
        for bs in reversed(sizes):
            self._capture(bs)
        logger.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def prepare(self, forward: ForwardBatch) -> ForwardBatch | None:
        """The batch padded to a captured size, planned on the forward thread just before its replay (into the
        graph's buffers); None (not a decode batch, or above the largest size) where no graph fits it."""
        padded = self.pad(forward)  # padding rows come last: the batch's logit rows stay where they were
        return padded if self.can_replay(padded) else None

    def claims(self, forward: ForwardBatch) -> bool:
        return self.can_replay(forward)

    def run(self, forward: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        logits = self.replay(forward)[rows]
        self.calls += 1
        return logits

    def pad(self, forward: ForwardBatch) -> ForwardBatch:
        """The batch a decode step runs as: padded to a captured size, or as it is (eager) when none fits."""
        if not one_token_each(forward):
            return forward
        size = padded_batch_size(self.sizes, forward.batch_size)
        return forward if size is None else pad_decode_batch(forward, size)

    def can_replay(self, forward: ForwardBatch) -> bool:
        return forward.batch_size in self.graphs and one_token_each(forward)

    def replay(self, forward: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] of a padded decode batch (pad() made it); valid until the next replay of the
        same size."""
        bs = forward.batch_size
        self.input_ids[:bs].copy_(forward.input_ids)
        self.positions[:bs].copy_(forward.positions)
        self.out_cache_loc[:bs].copy_(forward.out_cache_loc)
        self.backend.init_forward_metadata_graph(self._static(forward, bs))
        self.graphs[bs].replay()
        return self.logits[bs]

    def _static(self, forward: ForwardBatch, bs: int) -> ForwardBatch:
        """The batch over the fixed buffers (the addresses the graph was captured with)."""
        return dataclasses.replace(forward, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                                   out_cache_loc=self.out_cache_loc[:bs])

    def _capture(self, bs: int) -> None:
        forward = self._dummy_decode(bs)
        self.backend.init_forward_metadata_graph(forward)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy initialisation and autotuning must not happen inside the capture
                self.model.compute_logits(self.model(forward, self.backend))
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.logits[bs] = self.model.compute_logits(self.model(forward, self.backend))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def _dummy_decode(self, bs: int) -> ForwardBatch:
        """A decode batch of bs one-token requests over request row 0 and KV slot 0 (never handed out): its
        writes land where nothing lives, and what it reads does not matter."""
        host = dict(dtype=torch.long, device="cpu")
        ones = torch.ones(bs, **host)
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=torch.zeros(bs, **host), prefix_lens=ones, extend_lens=ones.clone(), seq_lens=ones + 1,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
        )


def capture_decode_graphs(args: EngineArgs, model, backend, tp_size: int, req_pool: ReqToTokenPool,
                          kv_pool: TokenToKVPool) -> CudaGraphRunner | None:
    """Decode CUDA graphs on a GPU, unless disabled; not under tensor parallelism (each rank would need its own
    graphs replayed in step), with a backend whose metadata has no fixed buffers (torch_native), nor for a model
    whose decode cannot be captured (capturable)."""
    sizes = capture_batch_sizes(args)
    if not sizes:
        return None
    why_not = why_no_graphs(model, backend, tp_size)
    if why_not:
        logger.warning("decode runs without CUDA graphs: %s", why_not)
        return None
    return CudaGraphRunner(model, backend, sizes, req_pool, kv_pool, args.device)


def why_no_graphs(model, backend, tp_size: int) -> str | None:
    if tp_size > 1:
        return "tensor parallelism"
    if not supports_cuda_graphs(backend):
        return f"attention backend {type(backend).__name__} cannot be captured"
    return capturable(model)
