"""The interface the scheduler uses for prefix caching; the radix cache and the chunk cache both implement it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class MatchResult:
    indices: torch.Tensor  # KV slots of the matched prefix, int64
    last_node: Any  # handle to lock while the request uses the prefix


class PrefixCache(Protocol):
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key` (token ids)."""

    def inc_lock_ref(self, node: Any) -> None:
        """Protect a matched path from eviction while a request reads it."""

    def dec_lock_ref(self, node: Any) -> None: ...

    def cache_unfinished_req(self, req: Any) -> None:
        """Make the KV a running request has computed so far shareable, and point the request at the cached copy."""

    def cache_finished_req(self, req: Any) -> None:
        """Hand a finished request's KV to the cache (or free it) and release its request slot."""

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens KV slots held only by the cache if possible; returns how many were freed."""

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def owned_slots(self) -> torch.Tensor:
        """Every KV slot the cache itself holds."""

    def flush(self) -> bool:
        """Drop everything cached; refused (False) while any request holds a lock."""

    def retire(self) -> int:
        """The weights changed: never serve K/V cached so far again (free it, or once its readers finish); returns
        the tokens still held by running requests."""

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
