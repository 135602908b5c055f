"""The model as an engine serves it: loaded, packed and quantized; shared by the engine and the graph builder,
which must build the very model the engine runs."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel_state import TensorParallel
from ..model.packed_linear import pack_linears, packs
from ..model.weights.loader import load_model
from ..model.weights.quantized import QuantizedModel
from .compiled_decode import compilable


def load_serving_model(model_path: str, dtype: torch.dtype, quantization: str, graphs: bool, device: str = "cpu",
                       tp: TensorParallel | None = None, quantized_rows: int | None = None,
                       ) -> tuple[nn.Module, QuantizedModel]:
    """The model as an engine runs it: loaded, its bfloat16 linears packed, its quantized layers swapped in, with
    the kernels compiled decode calls best where graphs run it (quantized_rows: auto's limit, measured before)."""
    tp = tp or TensorParallel(0, 1)
    model = load_model(model_path, dtype, device, tp)
    if packs(dtype, device):  # before quantization=auto times the dense layers against int4
        pack_linears(model)
    # The GGUF kernels hold whole tensors, so a split model runs dense (config refuses an explicit "gguf"); they
    # are CPU kernels, so a GPU runs dense weights too.
    if quantization == "gguf" and device != "cpu":
        raise ValueError(f"quantization='gguf' runs torch's CPU kernels only; device is {device!r} "
                         "(use quantization='auto' or 'none')")
    if quantization == "none" or tp.size > 1 or device != "cpu":
        return model, QuantizedModel()
    from ..model.weights.quantize import apply_quantization  # gguf and its readers: not worth importing otherwise

    for_graphs = graphs and compilable(model) is None
    return model, apply_quantization(model, quantization, model_path, for_graphs, quantized_rows)
