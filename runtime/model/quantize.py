"""Run a GGUF's quantized tensors quantized: replace each linear layer whose checkpoint tensors are all of a type
quantized.py has a kernel for, keeping the GGUF's own blocks (no requantization for Q4_0/Q4_1)."""

from __future__ import annotations

import pathlib

from gguf import GGUFReader
from torch import nn

from .decoder import STACKED, DecoderForCausalLM
from .default_model import gguf_source
from .gguf_names import hf_name, rope_row_order
from .loader import cpu_has_native_bf16
from .quantized import SUPPORTED_TYPES, BlockWeights, SmallBatchQuantized, quantized_linear, read_blocks, stack_rows

# Rows up to which the quantized kernels beat bfloat16 matmuls (benchmarks: int4 at 8 rows ~ dense).
SMALL_BATCH_ROWS = 8

# Fused parameter -> the checkpoint projections it holds, in shard order.
FUSED_PARTS = {fused: [proj for proj, (target, _) in sorted(STACKED.items(), key=lambda kv: kv[1][1])
                       if target == fused] for fused, _ in STACKED.values()}


def gguf_block_weights(gguf_path: str | pathlib.Path) -> dict[str, BlockWeights]:
    """HF tensor name -> blocks, for every tensor of a supported quantized type (q/k rows in HF's rope order)."""
    reader = GGUFReader(gguf_path)
    heads = {"q_proj": _field(reader, "llama.attention.head_count"),
             "k_proj": _field(reader, "llama.attention.head_count_kv")}
    weights = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            continue
        cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists the fastest-varying dimension first
        blocks = read_blocks(kind, tensor.data, rows, cols)
        name = hf_name(tensor.name)
        proj = name.split(".")[-2]
        if proj in heads:
            blocks = blocks.take_rows(rope_row_order(rows, heads[proj]))
        weights[name] = blocks
    return weights


def _field(reader: GGUFReader, key: str) -> int:
    return int(reader.fields[key].contents())


def source_tensors(model: DecoderForCausalLM, module_name: str) -> list[str]:
    """The checkpoint tensors a linear layer was loaded from, in fused order."""
    for fused, parts in FUSED_PARTS.items():
        if module_name.endswith(f".{fused}"):
            return [f"{module_name[: -len(fused)]}{proj}.weight" for proj in parts]
    if module_name == "lm_head" and getattr(model.config, "tie_word_embeddings", False):
        return ["model.embed_tokens.weight"]
    return [f"{module_name}.weight"]


def quantize_model(model: DecoderForCausalLM, blocks: dict[str, BlockWeights], keep_dense: bool) -> list[str]:
    """Swap in quantized layers where every source tensor is quantized; the names of the layers swapped.
    A tied LM head gets its own quantized copy; the embedding lookup keeps the float table. keep_dense: the
    float layer stays beside the quantized one and serves batches of more than SMALL_BATCH_ROWS rows."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        sources = source_tensors(model, name)
        # A fused layer whose parts differ in type (llama.cpp's mixed Q4_K_M files) stays dense.
        if not all(s in blocks for s in sources) or len({blocks[s].kind for s in sources}) != 1:
            continue
        quantized = quantized_linear(stack_rows([blocks[s] for s in sources]), module.bias)
        if keep_dense:
            quantized = SmallBatchQuantized(quantized, module, SMALL_BATCH_ROWS)
        model.set_submodule(name, quantized)
        swapped.append(name)
    return swapped


def apply_quantization(model: DecoderForCausalLM, quantization: str, model_dir: str) -> list[str]:
    """gguf: a model converted from a GGUF runs its quantized tensors on the quantized kernels alone (the least
    memory); auto: where the CPU has native bfloat16 (the kernels' fast path), the quantized kernels serve small
    batches and the dense layers the rest (the fastest at every batch size, at 1.25x the dense weights' memory;
    a tied LM head shares the embedding); none: every weight dequantized to the engine's dtype."""
    if quantization == "none":
        return []
    gguf = gguf_source(model_dir)
    if gguf is None:
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' needs a model given as a .gguf file (or 'default'); "
                             f"{model_dir} is a plain model directory")
        return []
    if quantization == "auto" and not cpu_has_native_bf16():
        return []
    return quantize_model(model, gguf_block_weights(gguf), keep_dense=quantization == "auto")
