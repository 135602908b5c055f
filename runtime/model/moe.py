"""Sparse mixture-of-experts MLP block: Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE (which adds a gated shared expert).

The arithmetic follows transformers' default (grouped_mm) experts path op for op, so float32 outputs match HF's
block to rounding: softmax in float32, top-k, optional renormalisation, then each expert runs once over the tokens
routed to it (tokens sorted by expert), and a token's k weighted expert outputs are summed in one reduction.

Tensor parallelism splits every expert's intermediate size: a rank holds its columns of gate and up and the
matching rows of down (the shared expert likewise), so the block's partial outputs are summed by one all_reduce.
The router and the shared expert's sigmoid gate are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import SINGLE, TensorParallel
from .families import MoeStyle
from .layers import activation


class SparseMoE(nn.Module):
    """Router, stacked experts (w_gate_up [E, 2 * I_shard, H], w_down [E, H, I_shard]) and, for Qwen2-MoE, the
    shared expert. forward(x [T, H]) is the whole block's output; partial(x) this rank's share before the sum."""

    def __init__(self, config, style: MoeStyle, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, getattr(config, style.experts_field)
        self.top_k, self.tp_size = getattr(config, style.top_k_field), tp.size
        self.renormalize, self.weights_in_input_dtype = style.renormalizes(config), style.weights_in_input_dtype
        self.act, self.has_shared_expert = activation(config.hidden_act), style.shared_expert
        inner = _shard(getattr(config, style.intermediate_field), style.intermediate_field, tp)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, inner))
        if style.shared_expert:
            shared = _shard(config.shared_expert_intermediate_size, "shared_expert_intermediate_size", tp)
            self.shared_gate_up = nn.Linear(hidden, 2 * shared, bias=False)
            self.shared_down = nn.Linear(shared, hidden, bias=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        if self.tp_size > 1:  # one reduce for routed and shared experts together, as RowParallelLinear does
            dist.all_reduce(out)
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: the sum over ranks is the block's output."""
        weights, experts = self.route(x)
        out = self.routed(x, weights, experts)
        return out + self.shared(x) if self.has_shared_expert else out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert weights and ids, both [T, k]."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype) if self.weights_in_input_dtype else weights, experts

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows of (token, expert) pairs sorted by expert, so each expert's matmul runs once over its tokens."""
        sorted_ids, order = torch.sort(experts.reshape(-1))
        ends = torch.searchsorted(sorted_ids, torch.arange(self.w_down.shape[0], device=x.device), right=True,
                                  out_int32=True)  # group e is rows ends[e-1]:ends[e]
        gate, up = grouped_linear(x[order // self.top_k], self.w_gate_up, ends).chunk(2, dim=-1)
        out = grouped_linear(self.act(gate) * up, self.w_down, ends) * weights.reshape(-1)[order, None]
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        # One sum over a token's k rows (not k in-place adds): HF's rounding, also in bfloat16.
        return unsorted.view(x.shape[0], self.top_k, -1).sum(dim=1).to(x.dtype)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_down(self.act(gate) * up)


def _shard(size: int, field: str, tp: TensorParallel) -> int:
    if size % tp.size:
        raise ValueError(f"tp_size={tp.size} must divide the model's {field} ({size})")
    return tp.shard(size)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x[ends[e-1]:ends[e]] times weight[e].T for every expert e; weight is [E, out, in]."""
    if grouped_mm_supported(x):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):  # a loop over experts, skipping those without tokens
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
        start = end
    return out


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """On CPU torch 2.13's grouped_mm takes float32 and bfloat16 (measured: bit for bit F.linear's results, and as
    fast); on CUDA, PyTorch documents bfloat16 on sm80 and later. Elsewhere the caller loops over the experts."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)


@dataclass(frozen=True)
class MoePlacement:
    """Where one HF checkpoint tensor of a MoE block goes in SparseMoE, and which part of it this rank keeps."""

    param: str  # our parameter's name within SparseMoE
    expert: int | None = None  # its row of a stacked expert parameter; None: the whole parameter
    half: int | None = None  # 0 gate, 1 up: its half of a fused gate/up parameter's rows
    tp_dim: int | None = None  # the checkpoint tensor's dimension split across ranks; None: replicated
    fused: bool = False  # the checkpoint tensor is itself [gate; up] along tp_dim: each half is split on its own

    def load(self, param: torch.Tensor, tensor: torch.Tensor, tp: TensorParallel = SINGLE) -> None:
        """Copy this rank's part of checkpoint `tensor` into its place in `param`."""
        target, part = self.target(param), self.shard(tensor, tp)
        if target.shape != part.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {self.param} "
                             f"(this rank's part is {tuple(part.shape)}, its place {tuple(target.shape)})")
        with torch.no_grad():
            target.copy_(part)

    def target(self, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` this tensor fills."""
        if self.expert is not None and not 0 <= self.expert < param.shape[0]:
            raise ValueError(f"expert {self.expert} out of range: {self.param} holds {param.shape[0]} experts")
        view = param if self.expert is None else param[self.expert]
        rows = view.shape[0] // 2
        return view if self.half is None else view.narrow(0, self.half * rows, rows)

    def shard(self, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """This rank's part of checkpoint `tensor`."""
        if self.tp_dim is None or tp.size == 1:
            return tensor
        halves = tensor.chunk(2, dim=self.tp_dim) if self.fused else (tensor,)
        return torch.cat([half.chunk(tp.size, dim=self.tp_dim)[tp.rank] for half in halves], dim=self.tp_dim)


_PER_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
# Stacked expert tensors (transformers' in-memory layout) and the router: the same in every family.
_FIXED = {
    "gate.weight": MoePlacement("router.weight"),
    "experts.gate_up_proj": MoePlacement("w_gate_up", tp_dim=1, fused=True),
    "experts.down_proj": MoePlacement("w_down", tp_dim=2),
}
_SHARED = {
    "shared_expert.gate_proj.weight": MoePlacement("shared_gate_up.weight", half=0, tp_dim=0),
    "shared_expert.up_proj.weight": MoePlacement("shared_gate_up.weight", half=1, tp_dim=0),
    "shared_expert.down_proj.weight": MoePlacement("shared_down.weight", tp_dim=1),
    "shared_expert_gate.weight": MoePlacement("shared_expert_gate.weight"),
}


def moe_placement(style: MoeStyle, name: str) -> MoePlacement:
    """Where checkpoint tensor `name` (relative to the block: "experts.3.gate_proj.weight", "gate.weight") goes;
    a ValueError names any tensor the block has no place for."""
    fixed = _FIXED | (_SHARED if style.shared_expert else {})
    if name in fixed:
        return fixed[name]
    match = _PER_EXPERT.fullmatch(name)
    if match and match[2] in style.expert_names:
        return _expert_placement(style, int(match[1]), match[2])
    raise ValueError(f"{name!r} is no tensor of a {style.checkpoint_module} MoE block; expected one of "
                     f"{sorted(fixed)} or experts.<i>.<{'|'.join(style.expert_names)}>.weight")


def _expert_placement(style: MoeStyle, expert: int, projection: str) -> MoePlacement:
    gate, up, _ = style.expert_names
    if projection in (gate, up):
        return MoePlacement("w_gate_up", expert, half=0 if projection == gate else 1, tp_dim=0)
    return MoePlacement("w_down", expert, tp_dim=1)


def split_moe_name(style: MoeStyle, name: str) -> tuple[str, str] | None:
    """(layer path, name within the block) of a full checkpoint name under the layer's MoE module name, e.g.
    "model.layers.0.block_sparse_moe.gate.weight" -> ("model.layers.0", "gate.weight"); None for other names.
    Qwen's dense layers share the name "mlp": only a layer that is_sparse_layer holds a SparseMoE. transformers 5
    names Mixtral's block "mlp" in memory (an RL trainer's weight updates) and "block_sparse_moe" on disk: both
    are taken."""
    for module in dict.fromkeys((style.checkpoint_module, "mlp")):
        layer, marker, inner = name.partition(f".{module}.")
        if marker:
            return layer, inner
    return None
