"""A tiny llama GGUF written with the `gguf` package: the default model's tokenizer, random weights, a mix of
quantization types (so a fused projection, an unquantized layer and a quantized LM head all occur)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 1024
HEAD_DIM = HIDDEN // HEADS
# GGUF tensor (after "blk.N.") -> type; attn_output stays float32, so one linear per layer stays dense.
LAYER_TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.F32,
               "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}
# Quantized linear layers the engine should build: qkv, gate_up and down per layer, plus the LM head.
QUANTIZED_LAYERS = 3 * LAYERS + 1


def _permute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary pairs), as its converter writes it."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@functools.cache
def source_fields(default_gguf: Path) -> dict[str, object]:
    """The default GGUF's vocabulary size and tokenizer fields, read once a process: gguf's reader takes ~4 s to
    parse its 49,152 tokens and merges, and the suite writes a dozen tiny GGUFs from them."""
    fields = GGUFReader(default_gguf).fields
    keys = ["llama.vocab_size", "tokenizer.chat_template", *(f"tokenizer.ggml.{key}" for key in (
        "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "padding_token_id"))]
    return {key: fields[key].contents() for key in keys}


def write_tokenizer(writer: GGUFWriter, default_gguf: Path, pre: str) -> None:
    """The default model's byte-level BPE vocabulary, special tokens and chat template, under pre-tokenizer pre."""
    source = source_fields(default_gguf)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        writer.add_uint32(f"tokenizer.ggml.{key}", int(source[f"tokenizer.ggml.{key}"]))
    writer.add_chat_template(source["tokenizer.chat_template"])


def build_tiny_gguf(path: Path, default_gguf: Path, seed: int = 0) -> Path:
    vocab = int(source_fields(default_gguf)["llama.vocab_size"])
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(HEAD_DIM)
    write_tokenizer(writer, default_gguf, "smollm")

    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.3, heads: int = 0) -> None:
        weight = (rng.standard_normal(shape) * scale).astype(np.float32)
        if heads:
            weight = _permute_rope(weight, heads)
        data = weight if qtype == Q.F32 else quantize(weight, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)

    add("token_embd.weight", (vocab, HIDDEN), Q.Q8_0)
    add("output.weight", (vocab, HIDDEN), Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    kv = KV_HEADS * HEAD_DIM
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for layer in range(LAYERS):
        for part, qtype in LAYER_TYPES.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part, 0)
            add(f"blk.{layer}.{part}.weight", shapes[part], qtype, heads=heads)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
