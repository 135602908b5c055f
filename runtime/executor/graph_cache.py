"""Compiled decode graphs kept on disk, keyed by everything their code depends on.

Tracing the default model's decode step takes ~25 s a graph on 2 cores even with inductor's caches warm; a graph
saved by torch's aot_compile loads in ~1-2 s. The key covers what a graph bakes in: the model's structure (each
module's type, plain attributes, and its tensors' names, shapes and dtypes; weights are read at each call), its
config, the KV pool's layout, the batch-size classes, torch's version and thread count, the CPU, and furcate's own
runtime sources. Anything else changed makes a new key, so a stale graph is never loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time

import torch
from torch import nn

from ..cache.memory_pool import TokenToKVPool
from ..cache_folder import furcate_cache
from ..kernels import paged_attention
from ..kernels.native_build import cpu_signature

logger = logging.getLogger("furcate.graph_cache")

RUNTIME = pathlib.Path(__file__).parents[1]
MAX_DEPTH = 6  # of plain values inside an attribute (a config's nested dicts)
# Graph folders no start has loaded for this long go (an older furcate's or torch's keys are never loaded again).
UNUSED_S = 30 * 24 * 3600


def use_furcate_inductor_cache() -> None:
    """Inductor's own cache (the C++ a loaded graph calls) in furcate's cache folder, which outlives /tmp, unless
    the user chose one; set before inductor first reads it, in this process and the builders it starts."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(furcate_cache() / "inductor"))


def plain(value: object, depth: int = 0) -> object:
    """A JSON-able stand-in for an attribute: numbers and strings as they are, tensors by shape and dtype, other
    objects by type (and their fields or to_dict(), when they have them); never an address."""
    if value is None or isinstance(value, bool | int | float | str):
        return value if not isinstance(value, float) else repr(value)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if depth >= MAX_DEPTH or isinstance(value, nn.Module):
        return type(value).__qualname__
    if isinstance(value, list | tuple):
        return [plain(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if callable(getattr(value, "to_dict", None)):
        return [type(value).__qualname__, plain(value.to_dict(), depth + 1)]
    return type(value).__qualname__


def model_signature(model: nn.Module) -> list:
    """Per module: its type, its public plain attributes, its own parameters' and buffers' shapes and dtypes."""
    signature = []
    for name, module in model.named_modules():
        attributes = {k: plain(v) for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
        tensors = [(n, plain(t)) for n, t in (*module.named_parameters(recurse=False),
                                              *module.named_buffers(recurse=False))]
        signature.append([name, type(module).__qualname__, attributes, tensors])
    return signature


@functools.cache
def runtime_sources_digest() -> str:
    """furcate's runtime code, which the traced step runs through."""
    digest = hashlib.sha256()
    for path in sorted(RUNTIME.rglob("*")):
        if path.suffix in (".py", ".c"):
            digest.update(str(path.relative_to(RUNTIME)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def graph_key(model: nn.Module, kv_pool: TokenToKVPool, sizes: list[int]) -> str:
    """The key of a set of decode graphs for this model, pool and batch-size classes on this machine."""
    pool = [(list(b.shape[1:]), str(b.dtype)) for b in (*kv_pool.k_buffer, *kv_pool.v_buffer)]
    parts = [model_signature(model), plain(getattr(model, "config", None)), pool, sizes, torch.__version__,
             torch.get_num_threads(), cpu_signature(), runtime_sources_digest(),
             os.environ.get("FURCATE_BLOCK_GEMV"), paged_attention.available()]
    text = json.dumps(parts, sort_keys=True, default=lambda v: type(v).__qualname__)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def graph_dir(key: str) -> pathlib.Path:
    return furcate_cache() / "graphs" / key


def graph_file(folder: pathlib.Path, bs: int) -> pathlib.Path:
    return folder / f"bs{bs}.bin"


def complete(folder: pathlib.Path, sizes: list[int]) -> bool:
    return all(graph_file(folder, bs).is_file() for bs in sizes)


def save_graph(folder: pathlib.Path, bs: int, graph: object) -> None:
    """One graph written whole (aot_compile writes a temporary file and renames it); complete() asks for every
    file, so a half-saved set is never loaded, while a build stopped half-way keeps the graphs it finished."""
    folder.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(graph_file(folder, bs)))


def save_graphs(folder: pathlib.Path, graphs: dict[int, object]) -> None:
    """Every graph saved (save_graph), then the folders long unused removed."""
    for bs, graph in graphs.items():
        save_graph(folder, bs, graph)
    prune_unused(folder.parent)


def prune_unused(root: pathlib.Path, now: float | None = None) -> list[pathlib.Path]:
    """Remove the graph folders under root that no start loaded (load_graphs touches what it loads) nor built
    for UNUSED_S; the folders removed."""
    cutoff = (time.time() if now is None else now) - UNUSED_S
    stale = [folder for folder in root.iterdir() if folder.is_dir() and folder.stat().st_mtime < cutoff]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def load_graphs(folder: pathlib.Path, sizes: list[int]) -> dict[int, object] | None:
    """The saved graphs, with their guards off (CompiledDecode picks a graph by batch size); None, and the folder
    removed so it is built again, when one does not load (a truncated or foreign file)."""
    graphs = {}
    try:
        for bs in sizes:
            with graph_file(folder, bs).open("rb") as f:
                graphs[bs] = torch.compiler.load_compiled_function(f)
            graphs[bs].disable_guard_check()
    except Exception as error:  # noqa: BLE001 - any unreadable graph: rebuild it, serve eagerly meanwhile
        logger.warning("the saved decode graphs in %s do not load (%s: %s); removing them", folder,
                       type(error).__name__, error)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    with contextlib.suppress(OSError):  # a read-only cache: the folder may be pruned after UNUSED_S
        os.utime(folder)
    return graphs
