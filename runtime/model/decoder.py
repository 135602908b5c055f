"""One decoder-only transformer for every family; each architecture is a set of flags (families.py).

Families differ in biases, norms and their placement, activation, rotary, windows, a few multipliers and, for the
mixture-of-experts families, a sparse MLP block (moe.py) in place of the gated MLP, so one implementation with
flags keeps every architecture on the same, tested forward path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..attention.base import AttentionBackend, ForwardBatch
from ..distributed.parallel_state import SINGLE, TensorParallel
from ..distributed.tp_layers import embedding, lm_head, shard_tensor
from .families import Family, Scales, layer_window
from .layers import Attention, AttentionSpec, GatedMLP, RMSNorm, attention_shape
from .moe import MoePlacement, SparseMoE, moe_placement, split_moe_name
from .rotary import CosSin, LayerRotary

# HF checkpoint names that we store fused: (fused parameter, shard index).
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Where a fused checkpoint tensor's part names sit (see DecoderForCausalLM.unfused).
FUSED_CHECKPOINT = {part: f".{fused}." for part, (fused, _) in STACKED.items()}
# Block norms by layout (families.Family.layout): the checkpoint names each layer has.
LAYOUT_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
# Where a checkpoint tensor goes within its parameter: all of it (None), its (start, length) rows of a fused one,
# or its place in a MoE block (an expert's slot of a stacked parameter, and how ranks split it).
Where = tuple[int, int] | MoePlacement | None


def attention_spec(config, family: Family, scales: Scales, layer_id: int) -> AttentionSpec:
    """How layer layer_id's attention differs by family and config."""
    bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = bool(getattr(config, family.qkv_bias_field, False))
    return AttentionSpec(
        qkv_bias=qkv_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=bias if family.o_bias is None else family.o_bias,
        qk_norm=family.qk_norm,
        norm_style=family.norm_style,
        scaling=scales.attention,
        logit_cap=scales.attention_logit_cap,
        sliding_window=layer_window(config, family, layer_id),
        clip_qkv=getattr(config, "clip_qkv", None),
    )


def mlp_block(config, family: Family, layer_id: int, tp: TensorParallel) -> nn.Module:
    """A MoE family's sparse block, or the gated MLP (also in a Qwen MoE model's dense layers)."""
    if family.moe is not None and family.moe.is_sparse_layer(config, layer_id):
        return SparseMoE(config, family.moe, tp)
    return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), tp,
                    getattr(config, family.activation_field))


class DecoderLayer(nn.Module):
    def __init__(self, config, family: Family, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        scales = family.scales(config)
        self.layout, self.residual_scale = family.layout, scales.residual
        self.self_attn = Attention(config, layer_id, attention_spec(config, family, scales, layer_id), tp)
        self.mlp = mlp_block(config, family, layer_id, tp)
        for name in LAYOUT_NORMS[family.layout]:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, family.norm_style))

    def forward(self, x: torch.Tensor, rotary: CosSin | None, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.scaled(self.attention_block(x, rotary, attn))
        return x + self.scaled(self.mlp_block(x))

    def attention_block(self, x: torch.Tensor, rotary: CosSin | None, attn: AttentionBackend) -> torch.Tensor:
        if self.layout == "pre":
            return self.self_attn(self.input_layernorm(x), rotary, attn)
        if self.layout == "sandwich":
            x = self.input_layernorm(x)
        return self.post_attention_layernorm(self.self_attn(x, rotary, attn))

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "pre":
            return self.mlp(self.post_attention_layernorm(x))
        if self.layout == "sandwich":
            x = self.pre_feedforward_layernorm(x)
        return self.post_feedforward_layernorm(self.mlp(x))

    def scaled(self, block_output: torch.Tensor) -> torch.Tensor:
        return block_output if self.residual_scale is None else block_output * self.residual_scale


class DecoderModel(nn.Module):
    def __init__(self, config, family: Family, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, family, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, family.norm_style)
        self.rotary = LayerRotary(config, attention_shape(config)[2])


class DecoderForCausalLM(nn.Module):
    """forward() returns final hidden states of all tokens; compute_logits() projects only the rows asked for.
    With tp (tensor parallelism) this rank holds its shard of every split parameter; see distributed/tp_layers."""

    def __init__(self, config, family: Family, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.family, self.tp = config, family, tp
        self.scales = family.scales(config)
        self.model = DecoderModel(config, family, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.begin_forward(batch)
        return self.hidden(self.embed(batch), batch.positions, attn, self.long_rope_rows(batch))

    def long_rope_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        """LongRoPE: the tokens of requests whose context outgrew the original one (they rotate by the long
        factors, as HF's model does once its input is that long); None for every other rotary."""
        long_after = self.model.rotary.long_after
        if long_after is None:
            return None
        per_token = torch.repeat_interleave(batch.rope_context_lens > long_after, batch.extend_lens)
        return per_token.to(batch.positions.device)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
               long_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of embedded tokens x at `positions`: the layers, then the last norm (what a
        compiled decode step traces, runtime/executor/compiled_decode.py)."""
        rotary = self.model.rotary(positions, x.dtype, long_rows)
        for layer, layer_rotary in zip(self.model.layers, rotary):
            x = layer(x, layer_rotary, attn)
        return self.model.norm(x)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Token embeddings; rows that show an image take the image encoder's (their ids are hash pads past
        the vocabulary, looked up as token 0 and overwritten)."""
        if batch.image_embeds is None:
            return self.embed_ids(batch.input_ids)
        x = self.embed_ids(batch.input_ids.masked_fill(batch.input_ids >= self.config.vocab_size, 0))
        rows, values = batch.image_embeds
        x[rows] = values.to(x.dtype)
        return x

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        if self.scales.embed is None:
            return x
        # In the weights' dtype, as HF rounds Gemma's sqrt(hidden) before multiplying.
        return x * torch.tensor(self.scales.embed, dtype=x.dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, divided (Granite) or soft-capped (Gemma 2) where the family does."""
        logits = self.lm_head(hidden).float()
        if self.scales.logit_divisor is not None:
            logits = logits / self.scales.logit_divisor
        cap = self.scales.final_logit_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused, partly stacked) parameters. Every element must be
        written, so a checkpoint lacking one part of a fused parameter or one expert of a stacked one is refused."""
        params = dict(self.named_parameters())
        filled: dict[str, dict[Where, int]] = {}
        for name, tensor in self.unfused(weights):
            place = self.destination(name)
            if place is None:
                continue
            target, where = place
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            filled.setdefault(target, {})[where] = self.write(params[target], name, tensor, where)
        missing = unfilled(params, filled)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")

    def write(self, param: torch.Tensor, name: str, tensor: torch.Tensor, where: Where) -> int:
        """Copy this rank's part of checkpoint tensor `name` to its place in `param`; the elements written."""
        view, part = placed_view(param, where), self.part(name, tensor, where)
        if view.shape != part.shape:
            raise ValueError(f"checkpoint tensor {name!r} of shape {list(tensor.shape)} does not fit: this rank's "
                             f"part is {list(part.shape)}, its place {list(view.shape)}")
        with torch.no_grad():
            view.copy_(part)
        return view.numel()

    def part(self, name: str, tensor: torch.Tensor, where: Where) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a MoE block's tensors are split as moe.py says; a fused
        one, which a weight update may send whole, part by part)."""
        if isinstance(where, MoePlacement):
            return where.shard(tensor, self.tp)
        if self.tp.size == 1:
            return tensor
        return torch.cat([self.shard(part, piece) for part, piece in self.unfused([(name, tensor)])], dim=0)

    def unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoints that store q/k/v or gate/up fused (Phi-3) split into the HF names of their parts, so the
        parts are placed and sharded as every other family's are."""
        for name, tensor in weights:
            parts = self.fused_parts(name)
            if parts is None:
                yield name, tensor
                continue
            sizes = [size for _, size in parts]
            for (part, _), piece in zip(parts, tensor.split(sizes, dim=0)):
                yield name.replace(FUSED_CHECKPOINT[part], f".{part}."), piece

    def fused_parts(self, name: str) -> list[tuple[str, int]] | None:
        """(HF part name, rows) of a fused checkpoint tensor, or None for any other tensor."""
        num_heads, num_kv_heads, head_dim = attention_shape(self.config)
        if ".self_attn.qkv_proj." in name:
            return [("q_proj", num_heads * head_dim), ("k_proj", num_kv_heads * head_dim),
                    ("v_proj", num_kv_heads * head_dim)]
        if ".mlp.gate_up_proj." in name:
            return [("gate_proj", self.config.intermediate_size), ("up_proj", self.config.intermediate_size)]
        return None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part; q/k norms over whole projections are split by heads, as their projections are."""
        if self.family.qk_norm == "projection" and (".q_norm." in name or ".k_norm." in name):
            return tensor.chunk(self.tp.size, dim=0)[self.tp.rank]
        return shard_tensor(name, tensor, self.tp)

    def destination(self, name: str) -> tuple[str, Where] | None:
        """Where HF checkpoint tensor `name` goes: our parameter, and where in it (see Where). None: nothing to
        load (rotary buffers; an LM head tied to the embedding, which holds it already)."""
        if "rotary_emb" in name:
            return None
        moe = self.moe_destination(name)
        if moe is not None:  # before the gate/up fusing, which would take experts.N.gate_proj for a dense MLP's
            return moe
        target, shard = _fused_target(name)
        if target == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        return target, None if shard is None else self._shard_range(target, shard)

    def moe_destination(self, name: str) -> tuple[str, MoePlacement] | None:
        """A tensor of a sparse layer's MoE block (Mixtral's block_sparse_moe is our mlp); None for any other,
        also for Qwen's dense layers, whose MLP shares the name "mlp"."""
        style = self.family.moe
        parts = None if style is None else split_moe_name(style, name)
        if parts is None or not self.is_sparse(parts[0]):
            return None
        layer, inner = parts
        place = moe_placement(style, inner)
        return f"{layer}.mlp.{place.param}", place

    def is_sparse(self, layer: str) -> bool:
        """Whether checkpoint layer path `layer` ("model.layers.3") is one of ours holding a SparseMoE."""
        index = layer.removeprefix("model.layers.")
        layers = self.model.layers
        return index.isdigit() and int(index) < len(layers) and isinstance(layers[int(index)].mlp, SparseMoE)

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        attn = self.model.layers[0].self_attn
        if ".qkv_proj." in target:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:  # every dense MLP's (a MoE model's layer 0 may be sparse)
            size = self.tp.shard(self.config.intermediate_size)
            sizes = [size, size]
        return sum(sizes[:shard]), sizes[shard]


def placed_view(param: torch.Tensor, where: Where) -> torch.Tensor:
    """The part of `param` one checkpoint tensor fills."""
    if isinstance(where, MoePlacement):
        return where.target(param)
    return param if where is None else param.narrow(0, *where)


def unfilled(params: dict[str, torch.Tensor], filled: dict[str, dict[Where, int]]) -> list[str]:
    """The parameters (sorted) some elements of which no tensor wrote, given the elements written per place;
    a stacked MoE parameter's entry names the experts it lacks."""
    return [_describe(name, param, filled.get(name, {})) for name, param in sorted(params.items())
            if sum(filled.get(name, {}).values()) < param.numel()]


def _describe(name: str, param: torch.Tensor, pieces: dict[Where, int]) -> str:
    per_expert: dict[int, int] = {}
    for where, count in pieces.items():
        if isinstance(where, MoePlacement) and where.expert is not None:
            per_expert[where.expert] = per_expert.get(where.expert, 0) + count
    if not per_expert:
        return name
    lacking = [e for e in range(param.shape[0]) if per_expert.get(e, 0) < param[0].numel()]
    return f"{name} (experts {lacking})"


def _fused_target(name: str) -> tuple[str, int | None]:
    for hf_name, (fused, shard) in STACKED.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{fused}."), shard
    return name, None
