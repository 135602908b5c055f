"""Kernel choices by measurement on this CPU, kept on disk: up to how many rows quantization=auto's quantized
kernel beats the dense layer, from how many rows a float32 linear's oneDNN-packed copy beats F.linear, and whether
the dense GEMV beats the packed copy at one row (packed_linear.py).

The quantized kernels (block_gemv.c's integer dot products, or torch's int4/int8 kernels on bfloat16
activations) read 4-bit weights several times faster than a dense matmul at one row, but how far up the rows
they keep winning depends on the CPU: with native bfloat16 (avx512_bf16) the dense layers catch up sooner,
without it torch's kernels convert every product and may lose to float32. One flag cannot say which, so the
engine times both kernels on the model's own layers at start-up (1-2 s, once) and serves with the
quantized kernel only the batch sizes where it won. It times a run through many layers, not one: a step streams
every layer's weights from memory, while one layer's dense weights alone would sit in the cache and flatter the
dense kernel. A choice is kept on disk (remembered): measured again at every start, it could pick 4 rows one start
and 8 the next, and the compiled decode graphs, which bake the choice in, would never be found again.

A timing taken while other processes keep the CPUs busy says little (at a load of ~10 on 2 cores it chose no
quantized rows at all), so each measurement records how many cores others kept busy meanwhile (/proc/stat less
this process's own CPU time). Under load the choice is measured again until two timings in a row agree, else a
safe middle value stands in, and either is kept as provisional: the next start that finds the machine idle
measures it again, and a kept choice that changes leads to new graphs (their key covers it). Records written
before loads were recorded count as provisional. `furcate prepare --remeasure` forgets every kept choice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_folder import furcate_cache
from ..kernels.block_gemv import SOURCE
from ..kernels.native_build import cpu_signature, source_texts

logger = logging.getLogger("furcate.quantize")

ROW_LADDER = (1, 2, 4, 8, 16, 32)
# The quantized kernel must win by this share: a tie is not worth its memory and numerics.
MARGIN = 0.9
# Rows at which a float32 packed linear is timed against F.linear, and the share by which it must win.
PACKED_LADDER = (1, 8, 64)
PACKED_MARGIN = 0.95
# What stands in for quantization=auto's rows when timings under load disagree: at or below every idle
# measurement so far (4-8 rows against bfloat16 on avx512_bf16, 16 on an AVX512-VNNI CPU without it, 32 against
# float32), rows where the 4-bit kernel reads a quarter of the bytes.
SAFE_ROWS = 4
# A timing counts as taken under load when others kept more cores busy than this process's threads leave free,
# plus this margin (a burst of another process's work is not load).
BUSY_MARGIN_CORES = 0.5
MEASURE_TRIES = 2  # timings under load, at most (each costs a start its time again), before the fallback stands in
PROBE_S = 0.25  # how long a start watches the CPUs before measuring a provisional choice again
REDO = "`furcate prepare --remeasure` measures every choice again"
# False in a graph builder: it loads the engine's model again, and must take the choices the engine took (the
# graphs' key covers them), so there a provisional choice is kept even on an idle machine.
MEASURE_PROVISIONAL = True
T = TypeVar("T")


def best_seconds(paths: tuple[list[Callable], list[Callable]], x: torch.Tensor | list[torch.Tensor],
                 repeats: int = 3) -> tuple[float, float]:
    """Each path's best-of-repeats time for x (or x[i] for layer i) through all its layers in turn, the two timed
    alternately so that a burst of load elsewhere hits both alike; a first pass each warms lazy initialisation up."""
    best = [float("inf"), float("inf")]
    inputs = x if isinstance(x, list) else [x] * len(paths[0])
    with torch.inference_mode():
        for i in (0, 1, *([0, 1] * repeats)):
            started = time.perf_counter()
            for layer, layer_input in zip(paths[i], inputs):
                layer(layer_input)
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]


def small_batch_rows(quantized: list[nn.Module], dense: list[nn.Linear]) -> int:
    """The largest rung of ROW_LADDER up to which the quantized layers beat the dense ones (same shapes, in the
    same order) at every rung; 0 if they lost at one row already."""
    chosen = 0
    for rows in ROW_LADDER:
        widths = {layer.in_features: torch.randn(rows, layer.in_features).to(layer.weight.dtype) for layer in dense}
        quantized_s, dense_s = best_seconds((quantized, dense), [widths[layer.in_features] for layer in dense])
        logger.info("%d rows through %d layers: quantized %.0f us, dense %.0f us", rows, len(dense),
                    quantized_s * 1e6, dense_s * 1e6)
        if quantized_s > MARGIN * dense_s:
            break
        chosen = rows
    return chosen


def choice_path(parts: list) -> pathlib.Path:
    """Where a choice measured on this machine is kept: keyed by what it chose between (parts), the CPU (and what
    holds the kernels to less of it), the thread count and torch's version."""
    parts = [*parts, cpu_signature(), torch.get_num_threads(), torch.__version__]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]
    return furcate_cache() / "kernel_choice" / f"{key}.json"


def choice_file(quantized: list[nn.Module], dense: list[nn.Linear]) -> pathlib.Path:
    """Where quantization=auto's choice for these layers is kept: keyed by the kernels, the dense layers' shapes,
    dtype and packing, and the block kernel's sources (the .c and the headers it includes)."""
    return choice_path([[type(q).__qualname__ for q in quantized], [list(d.weight.shape) for d in dense],
                        [getattr(d, "from_rows", None) for d in dense], str(dense[0].weight.dtype),
                        source_texts(SOURCE), os.environ.get("FURCATE_BLOCK_GEMV")])


@dataclass(frozen=True)
class CpuCounters:
    """CPU time at one moment: busy seconds summed over the CPUs this process may run on (None without
    /proc/stat), and this process's own."""

    wall: float
    busy: float | None
    own: float


def cpu_counters() -> CpuCounters:
    return CpuCounters(time.monotonic(), busy_cpu_seconds(), time.process_time())


def busy_cpu_seconds() -> float | None:
    """Busy seconds so far of the CPUs this process may run on (/proc/stat's per-CPU lines: all but idle and
    iowait, steal included: a hypervisor's other guests take CPU as surely as other processes)."""
    try:
        lines = pathlib.Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    mine = {f"cpu{i}" for i in usable_cpus()}
    ticks = sum(sum(map(int, fields[1:4])) + sum(map(int, fields[6:9]))
                for fields in (line.split() for line in lines) if fields and fields[0] in mine)
    return ticks / os.sysconf("SC_CLK_TCK")


def usable_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def busy_elsewhere(start: CpuCounters, end: CpuCounters) -> float:
    """Cores that other processes kept busy on average between two readings (without /proc/stat: the load
    average beyond this process's threads)."""
    if start.busy is None or end.busy is None:
        return max(os.getloadavg()[0] - torch.get_num_threads(), 0.0)
    others = (end.busy - start.busy) - (end.own - start.own)
    return max(others, 0.0) / max(end.wall - start.wall, 1e-3)


def busy_limit() -> float:
    """The cores others may keep busy before a timing counts as taken under load: those this process's threads
    leave free, plus BUSY_MARGIN_CORES."""
    return max(len(usable_cpus()) - torch.get_num_threads(), 0) + BUSY_MARGIN_CORES


def timed(measure: Callable[[], T]) -> tuple[T, float]:
    """measure()'s result, and the cores others kept busy meanwhile."""
    start = cpu_counters()
    value = measure()
    return value, busy_elsewhere(start, cpu_counters())


def busy_now() -> bool:
    """Whether others keep the CPUs busy now, watched for PROBE_S."""
    return timed(lambda: time.sleep(PROBE_S))[1] > busy_limit()


@dataclass(frozen=True)
class Choice(Generic[T]):
    """A measured choice as kept on disk: its value, the most cores others kept busy while it was measured, and
    whether that was too many (provisional: measured again at the next idle start)."""

    value: T
    busy_cores: float | None  # None: kept by a furcate that did not record it
    provisional: bool

    def record(self) -> dict:
        return {"value": self.value, "busy_cores": self.busy_cores, "provisional": self.provisional,
                "busy_limit": busy_limit()}

    def how(self) -> str:
        if self.busy_cores is None:
            return "measured before loads were recorded: provisional"
        load = f"while others kept {self.busy_cores:.1f} cores busy"
        return f"measured {load}: provisional" if self.provisional else f"measured idle ({load})"


def steady(measure: Callable[[], T], fallback: T) -> Choice[T]:
    """measure()'s result as taken when the machine is idle; under load, measured again until two timings in a
    row agree, else `fallback` (a safe middle value, never one extreme a skewed timing picks), provisional."""
    limit, busiest, last = busy_limit(), 0.0, []  # last: the previous timing's value, in a list (None is a value)
    for _ in range(MEASURE_TRIES):
        value, busy = timed(measure)
        if busy <= limit:
            return Choice(value, busy, False)
        busiest = max(busiest, busy)
        if last == [value]:
            return Choice(value, busiest, True)
        last = [value]
    return Choice(fallback, busiest, True)


def kept(path: pathlib.Path, parse: Callable[[object], T]) -> Choice[T] | None:
    """The choice kept at path; None when there is none, or a damaged one (measured again)."""
    try:
        record = json.loads(path.read_text())
        busy = record.get("busy_cores")
        if busy is not None and not isinstance(busy, int | float):
            raise TypeError("not a load")
        return Choice(parse(record["value"]), busy, record.get("provisional", True) is not False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remembered(path: pathlib.Path, measure: Callable[[], T], parse: Callable[[object], T], what: str,
               fallback: T) -> T:
    """measure()'s result as kept at path (parse turns the saved JSON back into it, raising on anything else):
    measured when none is kept, or when the kept one is provisional and the machine is idle now."""
    choice = kept(path, parse)
    if choice is not None and (not choice.provisional or not MEASURE_PROVISIONAL or busy_now()):
        logger.info("%s: %s, kept (%s; %s)", what, choice.value, choice.how(), REDO)
        return choice.value
    choice = steady(measure, fallback)
    save(path, choice, what)
    log = logger.warning if choice.provisional else logger.info
    log("%s: %s, %s%s (%s)", what, choice.value, choice.how(),
        ", measured again at the next idle start" if choice.provisional else "", REDO)
    return choice.value


def save(path: pathlib.Path, choice: Choice, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(choice.record()))
        os.replace(scratch, path)
    except OSError as error:  # a read-only cache: measure again next start
        logger.warning("%s was not saved: %s", what, error)


def forget_choices() -> int:
    """Delete every kept choice (every model's: the next start of each measures again); how many there were."""
    paths = list((furcate_cache() / "kernel_choice").glob("*.json"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def remembered_rows(quantized: list[nn.Module], dense: list[nn.Linear]) -> int:
    """small_batch_rows as kept on this machine (remembered)."""
    return remembered(choice_file(quantized, dense), lambda: small_batch_rows(quantized, dense), int,
                      "quantization=auto's choice (quantized kernel up to this many rows)", SAFE_ROWS)


def packed_crossover(layers: list[nn.Linear]) -> int | None:
    """The smallest rung of PACKED_LADDER from which oneDNN's packed linear beats F.linear at every rung, timed
    through these layers (of one shape, each holding its packed copy); None when it loses at the top rung."""
    packed = [functools.partial(packed_call, layer) for layer in layers]
    plain = [functools.partial(plain_call, layer) for layer in layers]
    chosen = None
    for rows in reversed(PACKED_LADDER):
        x = torch.randn(rows, layers[0].in_features, dtype=layers[0].weight.dtype)
        packed_s, plain_s = best_seconds((packed, plain), x)
        logger.info("%d rows through %d %s linears: packed %.0f us, plain %.0f us", rows, len(layers),
                    list(layers[0].weight.shape), packed_s * 1e6, plain_s * 1e6)
        if packed_s > PACKED_MARGIN * plain_s:
            break
        chosen = rows
    return chosen


def packed_call(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def plain_call(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def packed_from_rows(layers: list[nn.Linear]) -> list[int | None]:
    """Per layer (each holding its packed copy), the rows from which it serves the packed copy, measured per
    weight shape and kept on this machine (packed_crossover); the fallback is F.linear, torch's own path."""
    return per_shape(layers, "packed_linear", packed_crossover, lambda rows: rows is None or rows in PACKED_LADDER,
                     "the packed linears' choice (packed from this many rows, per shape)", None)


def per_shape(layers: list[nn.Linear], name: str, measure: Callable[[list[nn.Linear]], T],
              valid: Callable[[object], bool], what: str, fallback: T) -> list[T]:
    """measure's result for each layer's weight shape (timed through all the layers of that shape), kept on this
    machine under `name` (remembered; `fallback` for each shape where it stands in); a kept value that is not
    `valid` measures again."""
    groups: dict[str, list[nn.Linear]] = {}
    for layer in layers:
        groups.setdefault(json.dumps(list(layer.weight.shape)), []).append(layer)
    path = choice_path([name, sorted(groups), str(layers[0].weight.dtype)])
    chosen = remembered(path, lambda: {shape: measure(group) for shape, group in groups.items()},
                        functools.partial(parse_per_shape, sorted(groups), valid), what,
                        dict.fromkeys(groups, fallback))
    return [chosen[json.dumps(list(layer.weight.shape))] for layer in layers]


def parse_per_shape(shapes: list[str], valid: Callable[[object], bool], saved: object) -> dict:
    if not isinstance(saved, dict) or sorted(saved) != shapes:
        raise ValueError("another model's choice")
    if not all(valid(value) for value in saved.values()):
        raise ValueError("not a value this choice takes")
    return saved


def gemv_wins(layers: list[nn.Linear]) -> bool:
    """Whether the dense GEMV beats what serves one row otherwise (oneDNN's packed linear where the layers pack
    from one row, else F.linear), timed through these layers (of one shape and one packing choice)."""
    gemv = [functools.partial(gemv_call, layer) for layer in layers]
    other = [functools.partial(one_row_call(layer), layer) for layer in layers]
    x = torch.randn(1, layers[0].in_features, dtype=layers[0].weight.dtype)
    gemv_s, other_s = best_seconds((gemv, other), x)
    logger.info("1 row through %d %s linears: dense GEMV %.0f us, %s %.0f us", len(layers),
                list(layers[0].weight.shape), gemv_s * 1e6, one_row_call(layers[0]).__name__, other_s * 1e6)
    return gemv_s <= PACKED_MARGIN * other_s


def one_row_call(layer: nn.Linear) -> Callable[[nn.Linear, torch.Tensor], torch.Tensor]:
    """What serves the layer one row without the GEMV: its packed copy where it packs from one row, else F.linear."""
    packs_one_row = getattr(layer, "packed", None) is not None and getattr(layer, "from_rows", None) == 1
    return packed_call if packs_one_row else plain_call


def gemv_call(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.furcate.dense_gemv(x, layer.weight, layer.bias)


def gemv_choice(layers: list[nn.Linear]) -> list[bool]:
    """Per layer (each a shape the GEMV takes), whether one row runs the dense GEMV, measured per weight shape and
    what serves one row otherwise the first time on this machine (gemv_wins)."""
    groups: dict[str, list[nn.Linear]] = {}
    for layer in layers:
        groups.setdefault(one_row_call(layer).__name__, []).append(layer)
    chosen = {id(layer): wins for name, group in groups.items()
              for layer, wins in zip(group, per_shape(group, f"dense_gemv/{name}", gemv_wins,
                                                      lambda wins: type(wins) is bool,
                                                      "the dense GEMV's choice (whether it serves one row, per "
                                                      "shape)", False))}
    return [chosen[id(layer)] for layer in layers]
