"""quantization=auto's choice, by measurement on this CPU: up to how many rows the quantized kernel beats the
dense layer.

The quantized kernels (block_gemv.c's integer dot products, or torch's int4/int8 kernels on bfloat16
activations) read 4-bit weights several times faster than a dense matmul at one row, but how far up the rows
they keep winning depends on the CPU: with native bfloat16 (avx512_bf16) the dense layers catch up sooner,
without it torch's kernels convert every product and may lose to float32. One flag cannot say which, so the
engine times both kernels on the model's own layers at start-up (well under a second) and serves with the
quantized kernel only the batch sizes where it won. It times a run through many layers, not one: a step streams
every layer's weights from memory, while one layer's dense weights alone would sit in the cache and flatter the
dense kernel. The choice is measured once per machine and model shape and then kept on disk (remembered_rows): on
a loaded machine a new measurement could pick 4 rows one start and 8 the next, and the compiled decode graphs,
which bake the choice in, would never be found again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time

import torch
from torch import nn

from ..cache_folder import furcate_cache
from ..native_build import cpu_signature
from .block_gemv import SOURCE

logger = logging.getLogger("furcate.quantize")

ROW_LADDER = (1, 2, 4, 8, 16, 32)
# The quantized kernel must win by this share: a tie is not worth its memory and numerics.
MARGIN = 0.9


def best_seconds(paths: tuple[list[nn.Module], list[nn.Module]], x: torch.Tensor,
                 repeats: int = 3) -> tuple[float, float]:
    """Each path's best-of-repeats time for x through all its layers in turn, the two timed alternately so that
    a burst of load elsewhere hits both alike; a first pass each warms lazy initialisation up."""
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for i in (0, 1, *([0, 1] * repeats)):
            started = time.perf_counter()
            for layer in paths[i]:
                layer(x)
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]


def small_batch_rows(quantized: list[nn.Module], dense: list[nn.Linear]) -> int:
    """The largest rung of ROW_LADDER up to which the quantized layers beat the dense ones (same shapes, in the
    same order) at every rung; 0 if they lost at one row already."""
    chosen = 0
    for rows in ROW_LADDER:
        x = torch.randn(rows, dense[0].in_features).to(dense[0].weight.dtype)
        quantized_s, dense_s = best_seconds((quantized, dense), x)
        logger.info("%d rows through %d layers: quantized %.0f us, dense %.0f us", rows, len(dense),
                    quantized_s * 1e6, dense_s * 1e6)
        if quantized_s > MARGIN * dense_s:
            break
        chosen = rows
    return chosen


def choice_file(quantized: list[nn.Module], dense: list[nn.Linear]) -> pathlib.Path:
    """Where the choice for these layers on this machine is kept: keyed by the kernels, shapes and dtype, the CPU,
    the thread count and the versions of torch and of the block kernel."""
    parts = [[type(q).__qualname__ for q in quantized], [list(d.weight.shape) for d in dense],
             str(dense[0].weight.dtype), cpu_signature(), torch.get_num_threads(), torch.__version__,
             SOURCE.read_text(), os.environ.get("FURCATE_BLOCK_GEMV"), os.environ.get("ATEN_CPU_CAPABILITY")]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]
    return furcate_cache() / "kernel_choice" / f"{key}.json"


def remembered_rows(quantized: list[nn.Module], dense: list[nn.Linear]) -> int:
    """small_batch_rows as measured the first time on this machine."""
    path = choice_file(quantized, dense)
    try:
        return int(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):  # not measured yet, or a damaged file: measure
        pass
    rows = small_batch_rows(quantized, dense)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"rows": rows}))
        os.replace(scratch, path)
    except OSError as error:  # a read-only cache: measure again next start
        logger.warning("quantization=auto's choice was not saved: %s", error)
    return rows
