"""Attention with FlashInfer's paged-KV kernels, the GPU path's fast backend (the furcate[gpu] extra).

The pools are token-major with page size 1, so a layer's K buffer [slots, kv_heads, head_dim] viewed as
[slots, 1, kv_heads, head_dim] is FlashInfer's NHD paged cache, and a page id is a KV slot.

Each batch is planned once, in init_forward_metadata on the scheduler thread: a prefill wrapper (causal) for
extend and mixed batches, a decode wrapper for decode batches, one per attention window the model uses
(window_left is part of a plan), and for requests that share a cached prefix (torch_native.prefix_groups) a
two-level cascade: the shared slots once for all of a group's queries, then each request's own slots, merged by
log-sum-exp. Layers then only run the planned kernels: no host work per layer.

With the overlap loop the scheduler plans batch N+1 while batch N's layers still run, and a wrapper keeps its plan
(and copies it to the GPU) in its own buffers; so consecutive batches plan into two alternating sets of wrappers.
When N+1 is planned, N-1 (the last user of that set) has completed: the scheduler takes a batch's result before
it plans the batch after next (Scheduler.step).

flashinfer is imported when the backend is built, so this module (and its checks) import anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.memory_pool import TokenToKVPool
from .base import ForwardBatch, ModelAttention, PlannedForward
from .flashinfer_plan import CascadePlan, PagedKVPlan, plan_cascade, plan_paged_kv, select_requests
from .torch_native import prefix_groups

# One float workspace for every wrapper (split-KV partial results); FlashInfer's recommended size. Zeroed: the
# decode wrapper's docs ask for that before first use.
WORKSPACE_BYTES = 128 * 1024 * 1024
KV_LAYOUT = "NHD"
PAGE_SIZE = 1
# FlashInfer's FA2 kernels, as SGLang uses them. "auto" would pick FA3 on sm90 for prefill and tensor-core decode:
# a second kernel family to compile and trust, for no gain at page size 1.
KERNELS = "fa2"
# What FlashInfer's attention kernels are built for: its JIT dtype map has no float32 (jit/utils.py dtype_map),
# and its prefill kernel loads a head in 64-wide steps (prefill.cuh load_q_global_smem); 64/128/256 are the head
# dims FlashInfer builds ahead of time (aot.py fa2_head_dim).
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
# From this many query heads per KV head the decode wrapper runs on tensor cores (the prefill kernel); below it the
# CUDA-core decode kernel, which is compiled for group sizes 1, 2, 3, 4 and 8 only (utils.cuh DISPATCH_GQA_GROUP_SIZE).
TENSOR_CORE_GROUP = 4

Attend = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def check_supported(model: ModelAttention) -> None:
    """Refuse, when the engine starts, a model FlashInfer's kernels cannot run."""
    if model.dtype not in DTYPES:
        raise ValueError(f"attention_backend 'flashinfer' runs float16 and bfloat16, not {model.dtype}; "
                         f"pass dtype='bfloat16' or 'float16', or use attention_backend 'triton' or 'torch_native'")
    if model.head_dim not in HEAD_DIMS:
        raise ValueError(f"attention_backend 'flashinfer' runs head_dim {HEAD_DIMS}, and this model's is "
                         f"{model.head_dim}; use attention_backend 'triton' or 'torch_native'")


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's window_left for our sliding_window. A query at position p may see key k iff
    p - k < sliding_window (torch_native); FlashInfer keeps k iff kv_idx + qo_len + window_left >= kv_len + qo_idx
    (attention/variants.cuh), where p = kv_len - qo_len + qo_idx: iff p - k <= window_left. -1: no window."""
    return -1 if sliding_window is None else sliding_window - 1


def paged(buffer: torch.Tensor) -> torch.Tensor:
    """A pool buffer [slots, kv_heads, head_dim] as FlashInfer's NHD paged cache with one-slot pages."""
    return buffer.view(buffer.shape[0], PAGE_SIZE, *buffer.shape[1:])


@dataclass
class FlashInferMetadata:
    out_cache_loc: torch.Tensor  # the batch's KV slots, on the pool's device
    attend: dict[int | None, Attend]  # by sliding window (None: full attention); planned for this batch


@dataclass
class CascadeRun:
    """Attention of a batch with shared-prefix groups: the groups' queries in two levels, the others plainly."""

    shared: Any  # BatchPrefillWithPagedKVCacheWrapper over each group's shared slots
    unique: Any  # ... over each grouped request's own slots, causal
    merge: Callable  # flashinfer.merge_state_in_place
    tokens: torch.Tensor  # the grouped queries' rows, on the device
    rest: Attend | None = None
    rest_tokens: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        grouped = q[self.tokens]
        out, lse = self.unique.run(grouped, kv, return_lse=True)
        self.merge(out, lse, *self.shared.run(grouped, kv, return_lse=True))
        result = out.new_empty(q.shape)
        result[self.tokens] = out
        if self.rest is not None:
            result[self.rest_tokens] = self.rest(q[self.rest_tokens], kv)
        return result


@dataclass
class GraphState:
    """Fixed metadata buffers for captured decode batches: every size's wrappers read slices of these, and a
    replay (one at a time, on the forward thread) rewrites them first."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32
    wrappers: dict[int, dict[int | None, Any]] = field(default_factory=dict)  # batch size -> window -> decode


class FlashInferAttention(PlannedForward):
    """GraphAttentionBackend over FlashInfer's BatchPrefill/BatchDecodeWithPagedKVCacheWrapper."""

    needs_model = True  # select.make_attention_backend passes the model's attention shape

    def __init__(self, model: ModelAttention) -> None:
        check_supported(model)
        self.flashinfer = importlib.import_module("flashinfer")
        self.model = model
        self.windows = model.windows
        self.workspace: torch.Tensor | None = None
        self.wrapper_sets: tuple[dict, dict] = ({}, {})
        self.next_set = 0
        self.graph: GraphState | None = None

    # -- planning (scheduler thread) ----------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        wrappers = self.wrapper_sets[self.next_set]
        self.next_set ^= 1
        pool = batch.token_to_kv_pool
        plan = plan_paged_kv(batch, PAGE_SIZE)
        cascade = plan_cascade(batch, prefix_groups(batch)) if None in self.windows else None
        attend: dict[int | None, Attend] = {}
        for window in self.windows:
            if window is None and cascade is not None:  # sliding-window layers skip cascade, as in torch_native
                attend[window] = self._plan_cascade(wrappers, batch, cascade)
            else:
                attend[window] = self._plan_plain(wrappers, batch.is_decode, plan, pool, window)
        batch.attn_metadata = FlashInferMetadata(self._on_device(batch.out_cache_loc, pool), attend)

    def _plan_plain(self, wrappers: dict, decode: bool, plan: PagedKVPlan, pool: TokenToKVPool,
                    window: int | None) -> Attend:
        """Every request of `plan` over its whole KV: the decode wrapper when each has one query, else prefill."""
        if decode:
            wrapper = self._wrapper(wrappers, "decode", window, pool)
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, *self._shape(pool),
                         **self._plan_options(pool, window))
            return wrapper.run
        return self._plan_prefill(self._wrapper(wrappers, "prefill", window, pool), plan, pool, window, causal=True)

    def _plan_prefill(self, wrapper: Any, plan: PagedKVPlan, pool: TokenToKVPool, window: int | None,
                      causal: bool) -> Attend:
        wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, *self._shape(pool),
                     causal=causal, **self._plan_options(pool, window))
        return wrapper.run

    def _plan_cascade(self, wrappers: dict, batch: ForwardBatch, cascade: CascadePlan) -> Attend:
        """Full attention of a batch with shared-prefix groups. Two prefill wrappers and a merge are what
        flashinfer.MultiLevelCascadeAttentionWrapper runs too, but it builds its wrappers with kernels "auto"."""
        pool = batch.token_to_kv_pool
        device = pool.k_buffer[0].device
        shared = self._wrapper(wrappers, "shared", None, pool)
        unique = self._wrapper(wrappers, "unique", None, pool)
        self._plan_prefill(shared, cascade.shared, pool, None, causal=False)  # the prefix precedes every query
        self._plan_prefill(unique, cascade.unique, pool, None, causal=True)
        run = CascadeRun(shared, unique, self.flashinfer.merge_state_in_place,
                         cascade.tokens.to(device, non_blocking=True))
        if len(cascade.rest):
            rest = select_requests(batch, cascade.rest)
            run.rest = self._plan_plain(wrappers, batch.is_decode, plan_paged_kv(rest, PAGE_SIZE), pool, None)
            run.rest_tokens = cascade.rest_tokens.to(device, non_blocking=True)
        return run

    def _wrapper(self, wrappers: dict, role: str, window: int | None, pool: TokenToKVPool) -> Any:
        """The set's wrapper for a role and window, made at its first use (each holds 16 MB of plan buffers)."""
        if (role, window) not in wrappers:
            wrappers[role, window] = self._new_decode(pool) if role == "decode" else self._new_prefill(pool)
        return wrappers[role, window]

    def _shape(self, pool: TokenToKVPool) -> tuple[int, int, int, int]:
        """(num_qo_heads, num_kv_heads, head_dim, page_size), the positional tail of both wrappers' plan; the KV
        layout's part read from the pool itself."""
        _, num_kv_heads, head_dim = pool.k_buffer[0].shape
        return self.model.num_heads, num_kv_heads, head_dim, PAGE_SIZE

    def _plan_options(self, pool: TokenToKVPool, window: int | None) -> dict:
        dtype = pool.k_buffer[0].dtype
        return dict(window_left=window_left(window), sm_scale=self.model.scaling, q_data_type=dtype,
                    kv_data_type=dtype, logits_soft_cap=self.model.logit_cap or 0.0)

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self.workspace

    def _new_prefill(self, pool: TokenToKVPool):
        workspace = self._workspace(pool.k_buffer[0].device)
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, KV_LAYOUT, backend=KERNELS)

    def _new_decode(self, pool: TokenToKVPool, **graph_buffers):
        workspace = self._workspace(pool.k_buffer[0].device)
        num_qo_heads, num_kv_heads, _, _ = self._shape(pool)
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, KV_LAYOUT, use_tensor_cores=num_qo_heads // num_kv_heads >= TENSOR_CORE_GROUP,
            backend=KERNELS, **graph_buffers)

    @staticmethod
    def _on_device(out_cache_loc: torch.Tensor, pool: TokenToKVPool) -> torch.Tensor:
        return out_cache_loc.to(pool.k_buffer[0].device, non_blocking=True)

    # -- CUDA graphs ----------------------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, device: str) -> None:
        self.graph = GraphState(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=device),
            kv_last_page_len=torch.ones(max_bs, dtype=torch.int32, device=device),
        )

    def init_forward_metadata_graph(self, batch: ForwardBatch) -> None:
        """Plan a padded decode batch into the fixed buffers. Every batch of a size shares them, so this runs on
        the thread that replays, right before the replay (or capture), never ahead of it like
        init_forward_metadata. batch.out_cache_loc must be the graph's own input buffer on the device: the
        captured KV write reads that address."""
        if self.graph is None:
            raise RuntimeError("init_cuda_graph_state must run before a decode batch is planned for CUDA graphs")
        pool = batch.token_to_kv_pool
        if batch.out_cache_loc.device != pool.k_buffer[0].device:
            raise ValueError("a captured batch's out_cache_loc must be the graph's buffer on the pool's device")
        plan = plan_paged_kv(batch, PAGE_SIZE)
        wrappers = self._graph_wrappers(batch.batch_size, pool)
        for window, wrapper in wrappers.items():
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, *self._shape(pool),
                         **self._plan_options(pool, window))
        batch.attn_metadata = FlashInferMetadata(batch.out_cache_loc, {w: d.run for w, d in wrappers.items()})

    def _graph_wrappers(self, bs: int, pool: TokenToKVPool) -> dict[int | None, Any]:
        """The decode wrappers of batch size bs, over slices of the fixed buffers, made at its first plan."""
        graph = self.graph
        if bs > len(graph.kv_last_page_len):
            raise ValueError(f"decode batch of {bs} exceeds the {len(graph.kv_last_page_len)} planned for graphs")
        if bs not in graph.wrappers:
            buffers = dict(paged_kv_indptr_buffer=graph.kv_indptr[: bs + 1], paged_kv_indices_buffer=graph.kv_indices,
                           paged_kv_last_page_len_buffer=graph.kv_last_page_len[:bs])
            graph.wrappers[bs] = {w: self._new_decode(pool, use_cuda_graph=True, **buffers) for w in self.windows}
        return graph.wrappers[bs]

    # -- the forward (forward thread) -------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
        logit_cap: float | None = None,
    ) -> torch.Tensor:
        if scaling != self.model.scaling or logit_cap != self.model.logit_cap:
            raise ValueError(f"layer {layer_id} scales by {scaling} capped at {logit_cap}, the plan by "
                             f"{self.model.scaling} capped at {self.model.logit_cap}")
        pool = self.batch.token_to_kv_pool
        pool.set_kv(layer_id, self.metadata.out_cache_loc, k, v)
        kv = (paged(pool.k_buffer[layer_id]), paged(pool.v_buffer[layer_id]))
        return self.metadata.attend[sliding_window](q, kv).view(q.shape[0], -1)
