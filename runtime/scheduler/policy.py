"""Orders the waiting queue before admission. Cache-aware policies read each request's matched prefix."""

from __future__ import annotations

import random
from collections import defaultdict

from .req import Req

# Above this many waiting requests, prefix-aware ordering costs more than it saves; fall back to arrival order.
CACHE_AWARE_LIMIT = 256


def order_waiting(waiting: list[Req], policy: str, rng: random.Random, root=None) -> list[Req]:
    """`root` is the radix tree's root (None without a radix cache); requests carry this round's match."""
    if policy in ("lpm", "dfs-weight") and (root is None or len(waiting) > CACHE_AWARE_LIMIT):
        policy = "fcfs"
    if policy == "fcfs":
        return list(waiting)
    if policy == "lpm":  # longest cached prefix first: their KV is hot and least is recomputed
        return sorted(waiting, key=lambda r: -len(r.prefix_indices))
    if policy == "dfs-weight":
        return dfs_weight_order(waiting, root)
    if policy == "lof":  # longest output first: long jobs start early, so the batch drains evenly
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)
    if policy == "random":
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        return shuffled
    raise ValueError(f"unknown schedule_policy {policy!r}")


def dfs_weight_order(waiting: list[Req], root) -> list[Req]:
    """Walk the tree depth first, heaviest subtree (most waiting requests) first, so requests under one node
    run together and their shared prefix stays cached while they do."""
    reqs_at = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = req.last_node or root
        reqs_at[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    ordered: list[Req] = []
    stack = [root]
    while stack:
        node = stack.pop()
        ordered.extend(reqs_at[id(node)])
        children = [c for c in node.children.values() if weight[id(c)] > 0]
        stack.extend(sorted(children, key=lambda c: weight[id(c)]))  # heaviest popped first
    return ordered
