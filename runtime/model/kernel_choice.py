"""quantization=auto's choice, by measurement on this CPU: up to how many rows the quantized kernel beats the
dense layer.

torch's int4/int8 CPU kernels run bfloat16 activations. Where the CPU has native bfloat16 (avx512_bf16) they
read 4-bit weights several times faster than a dense matmul at one row; elsewhere they convert every product
and may lose to float32. One flag cannot say which, so the engine times both kernels on one of the model's own
layers at start-up (~0.1-0.5 s) and serves with the quantized kernel only the batch sizes where it won.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger("furcate.quantize")

ROW_LADDER = (1, 2, 4, 8, 16, 32)
# The quantized kernel must win by this share: a tie is not worth its memory and numerics.
MARGIN = 0.9


def seconds_per_call(layer: nn.Module, x: torch.Tensor, calls: int = 4, repeats: int = 3) -> float:
    """Best-of-repeats mean time of layer(x); the first call warms caches and lazy initialisation up."""
    with torch.inference_mode():
        layer(x)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                layer(x)
            best = min(best, (time.perf_counter() - started) / calls)
    return best


def small_batch_rows(quantized: nn.Module, dense: nn.Linear) -> int:
    """The largest rung of ROW_LADDER up to which the quantized layer beat the dense one at every rung; 0 if it
    lost at one row already."""
    chosen = 0
    for rows in ROW_LADDER:
        x = torch.randn(rows, dense.in_features).to(dense.weight.dtype)
        quantized_s, dense_s = seconds_per_call(quantized, x), seconds_per_call(dense, x)
        logger.info("%d rows: quantized %.0f us, dense %.0f us", rows, quantized_s * 1e6, dense_s * 1e6)
        if quantized_s > MARGIN * dense_s:
            break
        chosen = rows
    return chosen
