"""Decode steps of small batches on CPU through one torch.compile'd forward (SGLang's --enable-torch-compile).

A batch-1 decode step of the default model is ~1,800 small eager ops (norms, rotary, reshapes, KV writes,
attention per layer): on a CPU their dispatch costs as much as the matmuls. Compiled, inductor fuses the
elementwise work into a few C++ loops per layer and calls the matmul kernels directly. The compiled function
sees only tensors (token ids, positions, the KV slots to write, the padded KV slot table and each request's
length), and attention inside it is a gather and a masked softmax over the paged pool (DecodeAttention) with no
planning, so one graph serves every KV length (dynamic shapes). torch specialises size 1, so batch 1 gets its own
graph and batches of 2 to torch_compile_max_bs share another; both compile at start-up, into a cache on disk that
later starts reuse.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention.base import ForwardBatch
from .cache.memory_pool import ReqToTokenPool, TokenToKVPool

logger = logging.getLogger("furcate.compiled_decode")


def inductor_cache_dir() -> pathlib.Path:
    """Where compiled kernels persist between runs (inductor's own default lives under /tmp)."""
    root = os.environ.get("FURCATE_CACHE") or "~/.cache/furcate"
    return pathlib.Path(root).expanduser() / "inductor"


# Declared on the low-level library API: torch.library.custom_op's Python wrapper cost ~100 us a call.
_LIBRARY = torch.library.Library("furcate", "DEF")
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
                "Tensor out_cache_loc, Tensor kv_index, Tensor mask, float scaling) -> Tensor")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, out_cache_loc: torch.Tensor, kv_index: torch.Tensor,
                     mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Writes one layer's new K/V, then attends each request's one query over its KV slots kv_index [B, L].
    An opaque op to the compiler: traced, a write into the pool would become a copy of the whole buffer."""
    k_buffer.index_copy_(0, out_cache_loc, k)
    v_buffer.index_copy_(0, out_cache_loc, v)
    shape = (*kv_index.shape, *k_buffer.shape[1:])
    keys = k_buffer.index_select(0, kv_index.reshape(-1)).view(shape)  # [B, L, Hkv, D]
    values = v_buffer.index_select(0, kv_index.reshape(-1)).view(shape)
    bsz, num_kv_heads = keys.shape[0], keys.shape[2]
    # The query heads of a KV group side by side: GQA without repeating K/V.
    grouped = q.view(bsz, num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
    out = F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scaling)
    return out.reshape(bsz, -1)


def _decode_attention_shape(q: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_LIBRARY.impl("decode_attention", decode_attention, "CPU")
torch.library.register_fake("furcate::decode_attention", _decode_attention_shape, lib=_LIBRARY)


@dataclass
class LayerKV:
    """The attention backend one compiled layer sees: its own K/V buffers and the step's layout."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_index: torch.Tensor
    masks: dict[int | None, torch.Tensor]  # by sliding window: [B, 1, 1, L]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                sliding_window: int | None) -> torch.Tensor:
        return torch.ops.furcate.decode_attention(q, k, v, self.k_buffer, self.v_buffer, self.out_cache_loc,
                                                  self.kv_index, self.masks[sliding_window], scaling)


def run_layer(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attn: LayerKV) -> torch.Tensor:
    return layer(x, cos, sin, attn)


class CompiledDecode:
    """Runs decode batches of up to max_bs requests through the compiled step; the runner's other batches stay
    eager. Same interface as CudaGraphRunner (pad, can_replay, replay), so the model runner treats both alike."""

    def __init__(self, model, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, max_bs: int) -> None:
        self.model, self.req_pool, self.kv_pool, self.max_bs = model, req_pool, kv_pool, max_bs
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.windows = {layer.self_attn.sliding_window for layer in model.model.layers}
        # One graph for every layer: their parameters are its inputs (torch inlines nn.Modules), so 30 layers
        # trace and compile once instead of 30 times.
        self.layer_step = torch.compile(run_layer, fullgraph=True, dynamic=True)
        started, self.warm = time.perf_counter(), False
        for bsz in sorted({1, min(2, max_bs)}):
            self.replay(self._dummy_decode(bsz))
        self.warm = True
        logger.info("compiled the decode step for batches of 1 to %d in %.1f s", max_bs,
                    time.perf_counter() - started)

    def pad(self, forward: ForwardBatch) -> ForwardBatch:
        return forward  # dynamic shapes: any batch size up to max_bs runs as it is

    def can_replay(self, forward: ForwardBatch) -> bool:
        return forward.batch_size <= self.max_bs and forward.is_decode

    def replay(self, forward: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] of a decode batch: the layers compiled, the few ops around them eager."""
        out_cache_loc, kv_index, masks = forward.out_cache_loc, *self._layout(forward)
        model = self.model.model
        # Past the warm-up only the guards that tell the two graphs apart (batch size 1 or more) are checked: the
        # layers, dtypes and buffers they were traced with never change, and a full check costs ~60 us a layer.
        with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=self.warm):
            x = model.embed_tokens(forward.input_ids)
            cos, sin = model.rotary(forward.positions, x.dtype)
            for layer, k_buffer, v_buffer in zip(model.layers, self.kv_pool.k_buffer, self.kv_pool.v_buffer):
                x = self.layer_step(layer, x, cos, sin, LayerKV(k_buffer, v_buffer, out_cache_loc, kv_index, masks))
            return self.model.compute_logits(model.norm(x))

    def _layout(self, forward: ForwardBatch) -> tuple[torch.Tensor, dict[int | None, torch.Tensor]]:
        """Each request's KV slots [B, L] in position order, and the keys its query sees per sliding window."""
        seq_lens = forward.seq_lens
        table = self.req_pool.req_to_token[forward.req_pool_indices, : int(seq_lens.max())]
        key_pos = torch.arange(table.shape[1])
        valid = key_pos[None, :] < seq_lens[:, None]
        # Past a request's length the table holds stale slots; slot 0 (never handed out) keeps masked reads tame.
        kv_index = torch.where(valid, table, torch.zeros_like(table))
        masks = {window: (valid if window is None else valid & ((seq_lens[:, None] - 1 - key_pos) < window))
                 [:, None, None, :] for window in self.windows}
        return kv_index, masks

    def _dummy_decode(self, bsz: int) -> ForwardBatch:
        """bsz one-token requests over request row 0 and KV slot 0 (never handed out): the compile's warm-up
        writes where nothing lives. Their KV length differs from bsz: torch gives dimensions of equal size one
        symbol, and a graph traced with them equal would only serve batches where they are."""
        zeros = torch.zeros(bsz, dtype=torch.long)
        ones = torch.ones(bsz, dtype=torch.long)
        return ForwardBatch(input_ids=zeros, positions=ones, out_cache_loc=zeros.clone(), req_pool_indices=zeros,
                            prefix_lens=ones, extend_lens=ones.clone(), seq_lens=ones + bsz + 2,
                            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool)
