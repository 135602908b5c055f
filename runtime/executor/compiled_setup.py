"""Compiled CPU decode for one model runner: whether decode is to run compiled, and its graphs loaded from disk,
compiled at start-up (enable_torch_compile) or built by a low-priority background process (unset) that the runner
adopts once they load (graph_builder.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..cache.memory_pool import TokenToKVPool
from ..config import EngineArgs
from .build_locks import key_lock, wait_lock
from .compiled_decode import CompiledDecode, compilable, compile_graphs, size_classes
from .graph_builder import BackgroundGraphs, BuildSpec, auto_compile_enabled, start_background_build
from .graph_cache import (
    complete,
    graph_dir,
    graph_file,
    graph_key,
    load_graphs,
    prune_unused,
    save_graph,
    use_furcate_inductor_cache,
)

logger = logging.getLogger("furcate.model_runner")


@dataclass
class DecodeTarget:
    """What the compiled step is traced over and keyed by: the model, its KV pool, where it came from."""

    model: nn.Module
    kv_pool: TokenToKVPool
    model_path: str
    dtype: torch.dtype
    quantized_max_rows: int


def wants_graphs(args: EngineArgs, tp_size: int) -> bool:
    """Whether decode is to run compiled: asked for, or (unset) by default on a CPU (graph_builder.py)."""
    wanted = args.enable_torch_compile
    if wanted is None:
        return args.device == "cpu" and tp_size == 1 and auto_compile_enabled()
    return wanted


def compiled_decode(args: EngineArgs, tp_size: int,
                    target: DecodeTarget) -> tuple[CompiledDecode | None, BackgroundGraphs | None]:
    """The compiled CPU decode step: its graphs loaded from disk, else compiled now (enable_torch_compile) or
    built in the background (unset: the build is returned, to adopt once its graphs load)."""
    if not wants_graphs(args, tp_size):
        return None, None
    why_not = ("the device is not a CPU (CUDA graphs capture decode there)" if args.device != "cpu" else
               "tensor parallelism" if tp_size > 1 else compilable(target.model))
    if why_not:
        if args.enable_torch_compile:
            logger.warning("enable_torch_compile: decode runs eagerly: %s", why_not)
        return None, None
    sizes = size_classes(max_batch(args), max(target.quantized_max_rows, 0))
    use_furcate_inductor_cache()
    key = graph_key(target.model, target.kv_pool, sizes)
    graphs = load_graphs(graph_dir(key), sizes) if complete(graph_dir(key), sizes) else None
    background = None
    if graphs is None and args.enable_torch_compile:
        graphs = compile_now(target, sizes, key)
    elif graphs is None:
        background = start_background_build(build_spec(args, target, sizes, key))
    return (adopted(args, target.model, target.kv_pool, graphs) if graphs else None), background


def max_batch(args: EngineArgs) -> int:
    return min(args.torch_compile_max_bs, args.max_running_requests)


def adopted(args: EngineArgs, model: nn.Module, kv_pool: TokenToKVPool, graphs: dict[int, object]) -> CompiledDecode:
    """Decode through these graphs (loaded, compiled now, or delivered by the background build)."""
    return CompiledDecode(model, kv_pool, max_batch(args), graphs)


def compile_now(target: DecodeTarget, sizes: list[int], key: str) -> dict[int, object] | None:
    """Compile at start-up, each graph saved for the next start as it is done, holding the key's lock (a build of
    the same key elsewhere is waited for, and what it saved is loaded); None (eager decode) if compiling fails."""
    folder = graph_dir(key)
    with key_held(folder):
        saved = load_graphs(folder, [bs for bs in sizes if graph_file(folder, bs).is_file()]) or {}
        compiled = compile_missing(target, sizes, [bs for bs in sizes if bs not in saved], folder)
    return None if compiled is None else {**saved, **compiled}


@contextlib.contextmanager
def key_held(folder: pathlib.Path) -> Iterator[None]:
    """The key's lock, waited for; none where the cache folder is read-only (nothing is saved there either)."""
    try:
        fd = wait_lock(key_lock(folder), lambda pid: logger.warning(
            "enable_torch_compile: another process (pid %s) builds these decode graphs: waiting for it", pid))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.close(fd)


def compile_missing(target: DecodeTarget, sizes: list[int], missing: list[int],
                    folder: pathlib.Path) -> dict[int, object] | None:
    """The graphs of `missing` compiled and saved; None if compiling fails."""
    if not missing:
        return {}
    logger.warning("enable_torch_compile: compiling %d decode graph(s) now (the default model's take ~30-40 s each "
                   "on 2 cores), saved for later starts", len(missing))
    try:
        graphs = compile_graphs(target.model, target.kv_pool, sizes, missing, functools.partial(save_quietly, folder))
    except Exception as error:  # noqa: BLE001 - e.g. no C++ compiler for inductor: serve eagerly, say why
        logger.warning("enable_torch_compile: decode runs eagerly: compiling it failed: %s: %s",
                       type(error).__name__, error)
        return None
    with contextlib.suppress(OSError):  # nothing saved (a read-only cache): nothing to prune either
        prune_unused(folder.parent)
    return graphs


def save_quietly(folder: pathlib.Path, bs: int, graph: object) -> None:
    """Save a graph; a full or read-only disk is said, not raised: serve compiled, compile next time."""
    try:
        save_graph(folder, bs, graph)
    except Exception as error:  # noqa: BLE001
        logger.warning("the compiled decode graph for batch size %d was not saved: %s: %s", bs,
                       type(error).__name__, error)


def build_spec(args: EngineArgs, target: DecodeTarget, sizes: list[int], key: str) -> BuildSpec:
    attn = target.model.model.layers[0].self_attn
    return BuildSpec(target.model_path, str(target.dtype).removeprefix("torch."), args.quantization,
                     target.quantized_max_rows, (len(target.model.model.layers), attn.num_kv_heads, attn.head_dim),
                     tuple(sizes), torch.get_num_threads(), key)
