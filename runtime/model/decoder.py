"""One decoder-only transformer that covers the Llama family; each architecture is a set of flags.

Families differ only in attention biases, q/k norm and sliding windows, so one implementation with flags keeps
every architecture on the same, tested forward path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.base import AttentionBackend, ForwardBatch
from ..distributed.parallel_state import SINGLE, TensorParallel
from ..distributed.tp_layers import embedding, lm_head, shard_tensor
from .layers import Attention, GatedMLP, RMSNorm, rotary_embedding


@dataclass(frozen=True)
class Family:
    qkv_bias: bool | None  # None: read config.attention_bias
    o_bias: bool | None
    qk_norm: bool = False
    # Mistral-style configs carry a model-wide sliding_window with no per-layer types.
    window_from_config: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(qkv_bias=None, o_bias=None),
    "MistralForCausalLM": Family(qkv_bias=False, o_bias=False, window_from_config=True),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Family(qkv_bias=None, o_bias=False, qk_norm=True),
}

# HF checkpoint names that we store fused: (fused parameter, shard index).
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def layer_window(config, family: Family, layer_id: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer_id] == "sliding_attention" else None
    return getattr(config, "sliding_window", None) if family.window_from_config else None


class DecoderLayer(nn.Module):
    def __init__(self, config, family: Family, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(
            config,
            layer_id,
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            qk_norm=family.qk_norm,
            sliding_window=layer_window(config, family, layer_id),
            tp=tp,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config, family: Family, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, family, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = rotary_embedding(config, head_dim)


class DecoderForCausalLM(nn.Module):
    """forward() returns final hidden states of all tokens; compute_logits() projects only the rows asked for.
    With tp (tensor parallelism) this rank holds its shard of every split parameter; see distributed/tp_layers."""

    def __init__(self, config, family: Family, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, family, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.begin_forward(batch)
        return self.hidden(self.embed(batch), batch.positions, attn)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Final hidden states of embedded tokens x at `positions`: the layers, then the last norm (what a
        compiled decode step traces, runtime/compiled_decode.py)."""
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Token embeddings; rows that show an image take the image encoder's (their ids are hash pads past
        the vocabulary, looked up as token 0 and overwritten)."""
        if batch.image_embeds is None:
            return self.model.embed_tokens(batch.input_ids)
        ids = batch.input_ids.masked_fill(batch.input_ids >= self.config.vocab_size, 0)
        x = self.model.embed_tokens(ids)
        rows, values = batch.image_embeds
        x[rows] = values.to(x.dtype)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; every parameter must be covered."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            place = self.destination(name)
            if place is None:
                continue
            target, rows = place
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if self.tp.size > 1:
                tensor = shard_tensor(name, tensor, self.tp)
            with torch.no_grad():
                (params[target] if rows is None else params[target].narrow(0, *rows)).copy_(tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)[:8]}")

    def destination(self, name: str) -> tuple[str, tuple[int, int] | None] | None:
        """Where HF checkpoint tensor `name` goes: our parameter, and its (start, length) rows in a fused one.
        None: nothing to load (rotary buffers; an LM head tied to the embedding, which holds it already)."""
        if "rotary_emb" in name:
            return None
        target, shard = _fused_target(name)
        if target == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        return target, None if shard is None else self._shard_range(target, shard)

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        attn = self.model.layers[0].self_attn
        if ".qkv_proj." in target:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            size = self.model.layers[0].mlp.intermediate_size
            sizes = [size, size]
        return sum(sizes[:shard]), sizes[shard]


def _fused_target(name: str) -> tuple[str, int | None]:
    for hf_name, (fused, shard) in STACKED.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{fused}."), shard
    return name, None
