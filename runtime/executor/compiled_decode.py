"""Decode steps on the CPU as one torch.compile'd graph: embedding, every layer with its attention, logits.

An eager decode step of a small batch is ~1,800 small ops; on a CPU, Python dispatching them costs as much as the
matmuls (SmolLM2-135M at batch 1: ~8 ms of a 24 ms step outside any op, ~6 ms more in elementwise ops the
compiler fuses). Inductor turns the step into a handful of fused C++ loops around the matmul and attention calls.

Shapes: the batch size and the longest context are dynamic, so three graphs cover every decode batch: batch 1
(torch specialises size 1), batches of 2 up to the quantized kernels' row limit, and bigger ones (the model picks
dense or quantized matmuls by row count, which a graph fixes). They are compiled ahead of time (torch's
aot_compile), so they can be saved and loaded without tracing again (graph_cache.py), either at start-up or in a
background builder (graph_builder.py); a batch no graph fits runs the same code eagerly, never a compile in the
middle of serving.

Attention reads the KV pool through a padded [B, L] slot table: paged_attention's kernel reads each request's
slots where they lie (an op in the graph); where that kernel is not built, the graph gathers the slots and runs SDPA
(unmasked at batch 1, where every key is the request's own). Lower-precision intermediates are
rounded where eager rounds them (emulate_precision_casts): the default model's quantized bfloat16 step at batch 1
gives eager's logits bit for bit; a dense one-row matmul, which inductor sums in its own order, differs by rounding
noise, as float32 reductions do in their last bits (greedy output equals HF's in float32: the tests check it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import paged_table
from ..attention.base import ForwardBatch
from ..cache.memory_pool import TokenToKVPool
from ..kernels import paged_attention
from .cuda_graph_runner import MOE_REASON, one_token_each

logger = logging.getLogger("furcate.compiled_decode")

# Lower-precision intermediates rounded where eager rounds them (see the module's docstring).
COMPILE_OPTIONS = {"emulate_precision_casts": True}


@dataclass
class DecodePlan:
    """What a compiled step reads of a decode batch's requests: KV slots padded to the longest (padding at slot 0,
    never handed out), the kernel's spans (paged_table.PagedTable) and, where the graph gathers for SDPA
    above batch 1, which slots are real."""

    kv_index: torch.Tensor  # [B, L]
    spans: torch.Tensor  # [3, B] int64
    key_valid: torch.Tensor | None  # [B, 1, 1, L] bool; None where the kernel reads the pool, or at batch 1


@torch.compiler.assume_constant_result  # traced as the constant it is (graph_key holds the kernel's presence)
def uses_paged_kernel(model, kv_dtype: torch.dtype) -> bool:
    """Whether the model's graphs attend through paged_attention's kernel (fixed when they are traced)."""
    attn = model.model.layers[0].self_attn
    return paged_attention.supports(attn.num_heads, attn.num_kv_heads, attn.head_dim, kv_dtype)


def plan_decode(forward: ForwardBatch, paged: bool) -> DecodePlan:
    """Reads the request table: on the scheduler thread (prepare), as the eager backends plan."""
    planned = paged_table.paged_table(forward)  # a decode batch: one new token after seq_len - 1 cached
    table, spans = planned.kv_index, planned.spans
    if paged or forward.batch_size == 1:
        return DecodePlan(table, spans, None)  # indexing by a tensor copied the rows already
    valid = torch.arange(table.shape[1])[None, :] < forward.seq_lens[:, None]
    return DecodePlan(torch.where(valid, table, torch.zeros_like(table)), spans, valid[:, None, None, :])


class PoolDecodeAttention:
    """The attention backend a compiled step traces: writes each layer's new K/V, then attends through
    paged_attention's op where it is built for the model (uses_paged_kernel), else gathers the planned slots for
    SDPA, with queries grouped under their KV head (one query per request), as torch_native does."""

    def __init__(self, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor], out_cache_loc: torch.Tensor,
                 plan: DecodePlan, paged: bool) -> None:
        self.k_buffers, self.v_buffers, self.out_cache_loc, self.plan = k_buffers, v_buffers, out_cache_loc, plan
        self.paged = paged

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                sliding_window: int | None) -> torch.Tensor:
        k_buffer, v_buffer = self.k_buffers[layer_id], self.v_buffers[layer_id]
        k_buffer.index_copy_(0, self.out_cache_loc, k)
        v_buffer.index_copy_(0, self.out_cache_loc, v)
        if self.paged:
            out = paged_attention.attention_op(q, k_buffer, v_buffer, self.plan.kv_index, self.plan.spans, scaling)
            return out.reshape(q.shape[0], -1)
        bsz, length = self.plan.kv_index.shape
        num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
        flat = self.plan.kv_index.reshape(-1)
        keys = k_buffer.index_select(0, flat).view(bsz, length, num_kv_heads, head_dim).transpose(1, 2)
        values = v_buffer.index_select(0, flat).view(bsz, length, num_kv_heads, head_dim).transpose(1, 2)
        grouped = q.view(bsz, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.plan.key_valid, scale=scaling)
        return out.reshape(bsz, -1)


def compilable(model) -> str | None:
    """Why the model's decode cannot run compiled, or None. Sliding windows and soft-capped scores would need
    their own attention in the graph; LongRoPE's per-request factors a plan input."""
    if model.family.moe is not None:
        return MOE_REASON
    attention = [layer.self_attn for layer in model.model.layers]
    if any(a.sliding_window is not None for a in attention):
        return "its layers have sliding windows"
    if any(a.logit_cap is not None for a in attention):
        return "its attention scores are soft-capped"
    if model.model.rotary.long_after is not None:
        return "its LongRoPE factors depend on each request's length"
    return None


def decode_step(model, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv_index: torch.Tensor, spans: torch.Tensor, key_valid: torch.Tensor | None,
                k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> torch.Tensor:
    """The traced step: logits [B, vocab] of one token per request. The model is an argument, so a saved graph
    holds no weights: it reads them from the model it is called with, also after weight updates. Attention goes
    through paged_attention's kernel where it is built for the model's shape (uses_paged_kernel)."""
    plan = DecodePlan(kv_index, spans, key_valid)
    attn = PoolDecodeAttention(k_buffers, v_buffers, out_cache_loc, plan,
                               uses_paged_kernel(model, k_buffers[0].dtype))
    return model.logits(model.hidden(model.embed_ids(input_ids), positions, attn))


def size_classes(max_bs: int, quantized_max_rows: int) -> list[int]:
    """The smallest batch size of each graph: batch 1 (torch specialises size 1), batches of 2 up to the
    quantized kernels' row limit, and bigger ones (the model picks dense or quantized matmuls by row count,
    which a graph fixes)."""
    return sorted({bs for bs in (1, 2, quantized_max_rows + 1) if 1 <= bs <= max_bs})


def example_inputs(bs: int, kv_pool: TokenToKVPool, paged: bool, dynamic_batch: bool) -> tuple:
    """A decode step of bs requests over KV slot 0 (never handed out), for tracing. The context length is
    dynamic, so the graph serves every length, and so is the pool's size, which follows free memory and so
    differs from start to start; with dynamic_batch the batch size is dynamic too. paged: the graph attends
    through paged_attention's kernel (no key mask)."""
    kv_index = torch.zeros(bs, 2, dtype=torch.long)
    key_valid = None if bs == 1 or paged else torch.ones(bs, 1, 1, 2, dtype=torch.bool)
    per_request = [torch.zeros(bs, dtype=torch.long) for _ in range(3)]  # ids, positions, KV slots
    spans = paged_attention.spans(torch.arange(bs), torch.ones(bs, dtype=torch.long), torch.ones(bs, dtype=torch.long))
    torch._dynamo.mark_dynamic(kv_index, 1)
    for buffer in (*kv_pool.k_buffer, *kv_pool.v_buffer):
        torch._dynamo.mark_dynamic(buffer, 0)
    if dynamic_batch:
        if key_valid is not None:
            torch._dynamo.mark_dynamic(key_valid, 3)
        torch._dynamo.mark_dynamic(spans, 1)
        for tensor in (kv_index, *per_request, *([key_valid] if key_valid is not None else [])):
            torch._dynamo.mark_dynamic(tensor, 0)
    return (*per_request, kv_index, spans, key_valid, kv_pool.k_buffer, kv_pool.v_buffer)


def compile_graph(model, kv_pool: TokenToKVPool, bs: int, dynamic_batch: bool = True):
    """decode_step compiled ahead of time for bs's size class: a graph that can be saved and loaded without
    tracing again (torch's aot_compile). Its guards are off once loaded: CompiledDecode picks the graph.
    dynamic_batch: the class holds more batch sizes than bs (batch 1 is always a class of its own)."""
    step = torch.compile(decode_step, fullgraph=True, options=COMPILE_OPTIONS)
    with torch._dynamo.config.patch(enable_aot_compile=True), torch.inference_mode():
        inputs = example_inputs(bs, kv_pool, uses_paged_kernel(model, kv_pool.dtype), bs > 1 and dynamic_batch)
        graph = step.aot_compile(((model, *inputs), {}))
    graph.disable_guard_check()
    return graph


def compile_graphs(model, kv_pool: TokenToKVPool, sizes: list[int], wanted: list[int] | None = None,
                   compiled: Callable[[int, object], None] | None = None) -> dict[int, object]:
    """The graphs of the size classes `wanted` (default: all of `sizes`), each handed to compiled() as soon as it
    exists (to save it: a build stopped half-way keeps what it finished), one progress line each."""
    wanted, graphs = sizes if wanted is None else wanted, {}
    for done, bs in enumerate(wanted, 1):
        started = time.perf_counter()
        # A class followed at once by the next holds one size: where the quantized kernels serve up to 2 rows, the
        # class from 2 is just 2, and its `rows <= 2` would pin a dynamic batch size to 2, which torch refuses.
        graphs[bs] = compile_graph(model, kv_pool, bs, bs + 1 not in sizes)
        if compiled is not None:
            compiled(bs, graphs[bs])
        logger.info("decode graph %d of %d (batch sizes from %d) compiled in %.1f s", done, len(wanted), bs,
                    time.perf_counter() - started)
    return graphs


class CompiledDecode:
    """Runs decode batches of up to max_bs requests through the graph of their size class; others stay on the
    eager path, as does a batch no graph fits: never a compile in the middle of serving."""

    def __init__(self, model, kv_pool: TokenToKVPool, max_bs: int, graphs: dict[int, object]) -> None:
        self.model, self.kv_pool, self.max_bs, self.graphs = model, kv_pool, max_bs, graphs
        self.paged = uses_paged_kernel(model, kv_pool.dtype)
        self.calls = 0

    def can_run(self, forward: ForwardBatch) -> bool:
        """A decode batch (one token per request, each after a prefix: a context of one would be a new graph) at
        one-axis positions, as the graphs were traced (they run without guards). An M-RoPE model's tokens after an
        image are one-axis too (shifted by the image's delta); three-axis ones come only with an image's tokens."""
        return (forward.batch_size <= self.max_bs and one_token_each(forward)
                and int(forward.prefix_lens.min()) > 0 and forward.positions.dim() == 1)

    def prepare(self, forward: ForwardBatch) -> ForwardBatch | None:
        """The batch with what the graphs read of it (its DecodePlan), where can_run accepts it; else None."""
        if not self.can_run(forward):
            return None
        forward.attn_metadata = plan_decode(forward, self.paged)
        return forward

    def claims(self, forward: ForwardBatch) -> bool:
        """Planned by prepare: a batch planned before these graphs were adopted runs eagerly, as it was planned."""
        return isinstance(forward.attn_metadata, DecodePlan)

    def run(self, forward: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Logits of `rows` (float32) of a batch prepare planned."""
        self.calls += 1
        plan: DecodePlan = forward.attn_metadata
        with torch.inference_mode():
            logits = self.step(forward.batch_size)(
                self.model, forward.input_ids, forward.positions, forward.out_cache_loc, plan.kv_index,
                plan.spans, plan.key_valid, self.kv_pool.k_buffer, self.kv_pool.v_buffer)
        return logits[rows]

    def step(self, bs: int):
        """The graph of bs's size class: the one of the largest smallest size not above it."""
        return self.graphs[max(size for size in self.graphs if size <= bs)]
