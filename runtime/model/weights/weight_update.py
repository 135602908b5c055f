"""New weights for a loaded model, as RL trainers send them: every tensor is checked before any is written.

A trainer names tensors as its HF model does (q_proj, gate_proj, ...); furcate stores some fused (qkv_proj,
gate_up_proj), so each name maps to a parameter and, for a fused one, its rows (DecoderForCausalLM.destination);
a MoE expert's tensor maps to its expert's slot of a stacked parameter. Under tensor parallelism the trainer still
sends whole tensors and each rank keeps its part (DecoderForCausalLM.part), as when it loaded the checkpoint.
A plan is made from names, dtypes and shapes alone, so an update whose tensors arrive one by one (a broadcast) is
refused before the first one is received, and none is written until all are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...wire.tensor_specs import TensorSpec, check_name
from ..decoder import Where, placed_view, unfilled


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes; param None: nothing to write (a tied LM head, rotary buffers)."""

    spec: TensorSpec
    param: str | None
    where: Where = None


class WeightWriter:
    """Plans and writes updates into one rank's model (dense parameters only: not GGUF-quantized layers)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.tp = model.tp

    def plan(self, specs: Iterable[TensorSpec]) -> list[Placement]:
        return [self.place(spec) for spec in specs]

    def place(self, spec: TensorSpec) -> Placement:
        found = self.model.destination(spec.name)
        if found is None:
            return Placement(spec, None)
        target, where = found
        if target not in self.params:
            raise ValueError(f"tensor {spec.name!r} has no place in the served model{self._why_missing(target)}")
        expected = tuple(placed_view(self.params[target], where).shape)
        # The part this rank would keep of a tensor of that shape (a meta tensor: no data is touched).
        kept = tuple(self.model.part(spec.name, torch.empty(spec.shape, device="meta"), where).shape)
        if kept != expected:
            raise ValueError(f"tensor {spec.name!r} has shape {list(spec.shape)}, which does not fit the served "
                             f"model's {target} (expects a shard of {list(expected)} per rank, tp_size "
                             f"{self.tp.size})")
        return Placement(spec, target, where)

    def unwritten(self, placements: list[Placement]) -> list[str]:
        """The parameters (or experts of stacked ones) that placements leave partly unwritten."""
        filled: dict[str, dict[Where, int]] = {}
        for place in placements:
            if place.param is not None:
                view = placed_view(self.params[place.param], place.where)
                filled.setdefault(place.param, {})[place.where] = view.numel()
        return unfilled(self.params, filled)

    def _why_missing(self, target: str) -> str:
        module = target.rsplit(".", 1)[0]
        if any(name.startswith(f"{module}.") for name, _ in self.model.named_buffers()):
            return (f" as a dense weight: {module} runs on GGUF-quantized kernels. Weight updates need dense "
                    "weights: start the engine with quantization='none'")
        return ""

    def write(self, placements: list[Placement], tensors: list[torch.Tensor]) -> None:
        """Write tensors (in plan order, already checked against it: check_values) into the parameters."""
        for place, tensor in zip(placements, tensors):
            if place.param is not None:
                self.model.write(self.params[place.param], place.spec.name, tensor, place.where)

    def read(self, name: str) -> torch.Tensor:
        """This rank's copy of checkpoint tensor `name` (its shard under tensor parallelism)."""
        found = self.model.destination(check_name(name))
        if found is None and "lm_head" in name:
            found = ("model.embed_tokens.weight", None)  # tied: the embedding is the LM head
        if found is None or found[0] not in self.params:
            raise ValueError(f"the served model has no tensor {name!r}")
        target, where = found
        return placed_view(self.params[target], where).detach()


def check_values(placements: list[Placement], tensors: list[torch.Tensor]) -> None:
    """Every tensor as its spec says, and finite: a NaN weight would serve NaN logits to every request."""
    if len(tensors) != len(placements):
        raise ValueError(f"expected {len(placements)} tensors, got {len(tensors)}")
    for place, tensor in zip(placements, tensors):
        spec = place.spec
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor {spec.name!r} arrived as {tensor.dtype} {list(tensor.shape)}, announced as "
                             f"{spec.dtype} {list(spec.shape)}")
        if place.param is not None and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"tensor {spec.name!r} holds NaN or infinite values; the old weights stay")
