"""The scheduler's own control calls: its counters (GetStats) and the KV integrity check (CheckIntegrity)."""

from __future__ import annotations

from typing import Any, Protocol

from ..kernels import fused_elementwise, paged_attention
from ..wire.control_calls import CheckIntegrity, GetStats
from .plugins.base import SchedulerHandle, SchedulerPlugin
from .plugins.rpc import Handler
from .req import Req


class Counted(SchedulerHandle, Protocol):
    """What the counters read of the scheduler beyond the plug-ins' handle: its queues, plug-ins and totals."""

    waiting: list[Req]
    chunked_req: Req | None
    plugins: list[SchedulerPlugin]
    prompt_tokens_total: int
    cached_tokens_total: int
    jumped_tokens: int


def scheduler_handlers(s: Counted) -> dict[type, Handler]:
    return {GetStats: lambda _: stats(s), CheckIntegrity: lambda _: check_integrity(s)}


def stats(s: Counted) -> dict[str, Any]:
    runner = s.runner
    counters = {
        "forward_seconds": runner.forward_seconds,
        "forward_calls": runner.forward_calls,
        "graph_forward_calls": runner.graph_calls,
        "compiled_forward_calls": 0 if runner.compiled is None else runner.compiled.calls,
        "decode_graphs": runner.decode_graphs(),
        "kv_available": runner.kv_pool.available_size(),
        "max_total_tokens": runner.max_total_tokens,
        "evictable_tokens": s.cache.evictable_size(),
        "protected_tokens": s.cache.protected_size(),
        "req_slots_available": runner.req_pool.available_size(),
        "max_running_requests": s.args.max_running_requests,
        "running": len(s.running),
        "waiting": len(s.waiting) + (s.chunked_req is not None),
        "num_retractions": s.memory.num_retractions,
        "evicted_tokens": s.memory.evicted_tokens,
        "new_token_ratio": s.memory.new_token_ratio,
        "prompt_tokens_total": s.prompt_tokens_total,
        "cached_tokens_total": s.cached_tokens_total,
        "jumped_tokens": s.jumped_tokens,
        "transfers_in_flight": len(s.held_requests()),
        "images_encoded": runner.images.encoded_images if runner.images is not None else 0,
        "native_kernels": native_kernels(s.args.device),
    }
    for plugin in s.plugins:
        counters.update(plugin.stats())
    return counters


def native_kernels(device: str) -> dict[str, bool]:
    """On a CPU, which C kernels this process runs (a switch turned off, or a build that failed, keeps torch's
    path; both are decided once, when the model first ran)."""
    if device != "cpu":
        return {}
    return {"paged_attention": paged_attention.available(), "fused_elementwise": fused_elementwise.available()}


def check_integrity(s: Counted) -> bool:
    s.memory.check_integrity(s.running + ([s.chunked_req] if s.chunked_req else []) + s.held_requests())
    return True
