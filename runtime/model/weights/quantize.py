"""Run a GGUF's quantized tensors quantized: replace each linear layer whose checkpoint tensors are all of a type
quantized.py has a kernel for, keeping the GGUF's own blocks (no requantization for Q4_0/Q4_1/Q4_K). Tensors of
other types (Q6_K, say) load dense, dequantized by the conversion."""

from __future__ import annotations

import pathlib

from torch import nn

from ..decoder import STACKED, DecoderForCausalLM
from ..kernel_choice import ROW_LADDER, remembered_rows
from .default_model import gguf_source
from .gguf_arch import GGUFArch, GGUFMeta, gguf_arch, open_gguf, rope_row_order
from .gguf_reader import GGUFTensor
from .quantized import (
    SUPPORTED_TYPES,
    BlockWeights,
    QuantizedModel,
    SmallBatchQuantized,
    quantized_linear,
    read_blocks,
    stack_rows,
)

# Fused parameter -> the checkpoint projections it holds, in shard order.
FUSED_PARTS = {fused: [proj for proj, (target, _) in sorted(STACKED.items(), key=lambda kv: kv[1][1])
                       if target == fused] for fused, _ in STACKED.values()}


def gguf_block_weights(gguf_path: str | pathlib.Path) -> dict[str, BlockWeights]:
    """HF tensor name -> blocks, for every tensor of a supported quantized type (rows in HF's order: the
    architecture's rope-permuted tensors unpermuted, as the converted directory has them)."""
    reader, meta = open_gguf(gguf_path)
    arch = gguf_arch(meta)
    weights = {}
    for tensor in reader.tensors:
        name = arch.hf_name(tensor.name)
        if tensor.tensor_type.name in SUPPORTED_TYPES and name is not None:
            weights[name] = _hf_blocks(arch, meta, tensor)
    return weights


def _hf_blocks(arch: GGUFArch, meta: GGUFMeta, tensor: GGUFTensor) -> BlockWeights:
    cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists the fastest-varying dimension first
    blocks = read_blocks(tensor.tensor_type.name, tensor.data, rows, cols)
    heads = arch.rope_heads(tensor.name, meta)
    return blocks.take_rows(rope_row_order(rows, heads)) if heads else blocks


def source_tensors(model: DecoderForCausalLM, module_name: str, blocks: dict[str, BlockWeights]) -> list[str]:
    """The checkpoint tensors a linear layer was loaded from, in fused order (one, for a file that stores the
    fused tensor itself: Phi-3's attn_qkv and ffn_up)."""
    if f"{module_name}.weight" in blocks:
        return [f"{module_name}.weight"]
    for fused, parts in FUSED_PARTS.items():
        if module_name.endswith(f".{fused}"):
            return [f"{module_name[: -len(fused)]}{proj}.weight" for proj in parts]
    if module_name == "lm_head" and getattr(model.config, "tie_word_embeddings", False):
        return ["model.embed_tokens.weight"]
    return [f"{module_name}.weight"]


def quantize_model(model: DecoderForCausalLM, blocks: dict[str, BlockWeights], dense_above: int | None,
                   for_graphs: bool = False) -> list[str]:
    """Swap in quantized layers where every source tensor is quantized; the names of the layers swapped.
    A tied LM head gets its own quantized copy; the embedding lookup keeps the float table. dense_above: the
    float layer stays beside the quantized one and serves batches of more rows than this; None: quantized alone.
    for_graphs: the kernels a compiled decode step calls best (quantized.quantized_linear)."""
    swapped = []
    for name, module in quantizable_layers(model, blocks):
        weights = stack_rows([blocks[s] for s in source_tensors(model, name, blocks)])
        quantized = quantized_linear(weights, module.bias, for_graphs)
        if dense_above is not None:
            quantized = SmallBatchQuantized(quantized, module, dense_above)
        model.set_submodule(name, quantized)
        swapped.append(name)
    return swapped


def quantizable_layers(model: DecoderForCausalLM, blocks: dict[str, BlockWeights]) -> list[tuple[str, nn.Linear]]:
    """The linear layers whose source tensors are all quantized, of one type."""
    found = []
    for name, module in model.named_modules():
        sources = source_tensors(model, name, blocks) if isinstance(module, nn.Linear) else []
        # A fused layer whose parts differ in type (llama.cpp's mixed Q4_K_M files) stays dense.
        if sources and all(s in blocks for s in sources) and len({blocks[s].kind for s in sources}) == 1:
            found.append((name, module))
    return found


def measured_rows(layers: list[SmallBatchQuantized]) -> int:
    """quantization=auto: up to how many rows the quantized kernels beat the dense ones on this CPU (0: never),
    timed over all of them, as a step runs them, once per machine (kernel_choice.remembered_rows). Timed over the
    largest shape alone (the MLPs' up projections, where the quantized kernel gains most) it chose 32 rows on an
    Xeon held to AVX2 (an emulated AVX2-only CPU) where the whole model ran 0.93x the dense time there, and batches of
    17-32 ran 10-14% slower."""
    return remembered_rows([m.quantized for m in layers], [m.dense for m in layers])


def measured_quantization(model: DecoderForCausalLM, blocks: dict[str, BlockWeights],
                          for_graphs: bool = False, rows: int | None = None) -> QuantizedModel:
    """auto: quantized layers beside the dense ones, serving the batch sizes where they measured faster (or up to
    `rows`, measured before); the dense layers alone again where they never were."""
    names = quantize_model(model, blocks, dense_above=ROW_LADDER[-1], for_graphs=for_graphs)
    layers = [model.get_submodule(name) for name in names]
    below_head = [layer for name, layer in zip(names, layers) if name != "lm_head"]
    if rows is None:
        rows = measured_rows(below_head) if below_head else 0
    for name, layer in zip(names, layers):
        layer.max_rows = rows
        if not rows:
            model.set_submodule(name, layer.dense)
    return QuantizedModel(names, rows) if rows else QuantizedModel()


def apply_quantization(model: DecoderForCausalLM, quantization: str, model_dir: str,
                       for_graphs: bool = False, rows: int | None = None) -> QuantizedModel:
    """gguf: a model converted from a GGUF runs its quantized tensors on the quantized kernels alone (the least
    memory); auto: the quantized kernels serve the batch sizes where they measured faster than the dense layers
    on this CPU (kernel_choice.py), the dense layers the rest (at 1.25x the dense weights' memory; a tied LM head
    shares the embedding), and nothing is quantized where they never won (rows: auto's limit as measured before,
    by the engine a graph builder copies); none: every weight dequantized to the engine's dtype."""
    if quantization == "none":
        return QuantizedModel()
    gguf = gguf_source(model_dir)
    if gguf is None:
        if quantization == "gguf":
            raise ValueError(f"quantization='gguf' needs a model given as a .gguf file (or 'default'); "
                             f"{model_dir} is a plain model directory")
        return QuantizedModel()
    blocks = gguf_block_weights(gguf)
    if quantization == "gguf":
        return QuantizedModel(quantize_model(model, blocks, dense_above=None, for_graphs=for_graphs), -1)
    return measured_quantization(model, blocks, for_graphs, rows)
