"""A Llama-3.2-1B-shaped model with random weights for benchmarks/peers.py, written once as a GGUF that furcate,
llama.cpp, vLLM and HF all load (vLLM and HF through furcate's conversion of it to an HF directory).

The shape is meta-llama/Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, intermediate 8192,
tied embeddings, rope theta 500000, RMS eps 1e-5, context 131072) with two differences:
  - vocabulary 49152 with SmolLM2's tokenizer (copied from the default model's GGUF metadata) instead of Llama
    3's 128256: llama.cpp needs a working tokenizer in the file, and the workloads are SmolLM2 token ids. The
    model has 1.07B parameters instead of 1.24B; its tied LM head is 101M of them instead of 263M.
  - no llama3 rope scaling: llama.cpp takes it as a `rope_freqs.weight` tensor, which furcate's GGUF converter
    leaves out (as transformers' GGUF loading does), so its LlamaConfig would not carry the scaling. The
    scaling changes rotary frequencies, not the cost of a step, so every system runs plain rope theta 500000.
Weights are normal with std 0.02 (norm weights 1), which keeps the activations of 16 random layers finite. Every
2-D weight is stored as Q4_0 (or Q4_1), token_embd included, as `llama-quantize --pure` writes it (a plain
llama-quantize run would give a tied token_embd Q6_K, the way SmolLM2's file has it Q8_0); the norms stay F32,
as in every llama.cpp file.
"""

from __future__ import annotations

import pathlib

import numpy as np

from .peer_llama_cpp import finish_gguf

SHAPE_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 49152,
            "rope_theta": 500000.0, "rms_eps": 1e-5, "context": 131072}
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3}  # general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0 / Q4_1
STD = 0.02


def layer_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in llama.cpp's converter order."""
    hidden, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    tensors = [("token_embd.weight", (shape["vocab"], hidden))]
    for i in range(shape["layers"]):
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,)),
                    (f"blk.{i}.ffn_down.weight", (hidden, shape["intermediate"])),
                    (f"blk.{i}.ffn_gate.weight", (shape["intermediate"], hidden)),
                    (f"blk.{i}.ffn_up.weight", (shape["intermediate"], hidden)),
                    (f"blk.{i}.ffn_norm.weight", (hidden,)),
                    (f"blk.{i}.attn_k.weight", (kv, hidden)),
                    (f"blk.{i}.attn_output.weight", (hidden, hidden)),
                    (f"blk.{i}.attn_q.weight", (hidden, hidden)),
                    (f"blk.{i}.attn_v.weight", (kv, hidden))]
    return tensors + [("output_norm.weight", (hidden,))]


def metadata(shape: dict, qtype: str) -> dict[str, int | float | str]:
    return {"general.type": "model", "general.name": "Llama-3.2-1B shape, random weights",
            "general.file_type": FILE_TYPES[qtype], "general.quantization_version": 2,
            "llama.block_count": shape["layers"], "llama.context_length": shape["context"],
            "llama.embedding_length": shape["hidden"], "llama.feed_forward_length": shape["intermediate"],
            "llama.attention.head_count": shape["heads"], "llama.attention.head_count_kv": shape["kv_heads"],
            "llama.rope.freq_base": shape["rope_theta"],
            "llama.attention.layer_norm_rms_epsilon": shape["rms_eps"], "llama.vocab_size": shape["vocab"],
            "llama.rope.dimension_count": shape["hidden"] // shape["heads"]}


def write_random_gguf(target: pathlib.Path, tokenizer_gguf: pathlib.Path, shape: dict, qtype: str = "Q4_0",
                      seed: int = 0) -> pathlib.Path:
    """The model at `target` (kept if already there): random weights, 2-D ones quantized to qtype, and the
    tokenizer fields of tokenizer_gguf, whose vocabulary size the shape must have."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    if target.exists():
        return target
    reader = GGUFReader(tokenizer_gguf)
    if len(reader.fields["tokenizer.ggml.tokens"].data) != shape["vocab"]:
        raise ValueError(f"{tokenizer_gguf.name}: its tokenizer does not have {shape['vocab']} tokens")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = GGUFWriter(str(partial), "llama")
    for key, value in metadata(shape, qtype).items():
        value_type = {str: GGUFValueType.STRING, float: GGUFValueType.FLOAT32}.get(type(value), GGUFValueType.UINT32)
        writer.add_key_value(key, value, value_type)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    kind = GGMLQuantizationType[qtype]
    for index, (name, dims) in enumerate(layer_tensors(shape)):
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        # One generator per tensor: the weights do not depend on the order tensors are written in.
        weights = np.random.default_rng([seed, index]).standard_normal(dims, dtype=np.float32) * STD
        writer.add_tensor(name, quantize(weights, kind), raw_dtype=kind)
    return finish_gguf(writer, partial, target)
