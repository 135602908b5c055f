"""Radix tree over token ids whose nodes own KV slots: shared prefixes are computed and stored once.

Every KV slot is owned either by a running request (its not-yet-cached tail) or by exactly one tree node.
A node's lock count says how many running requests read it (through any descendant); only unlocked leaves are
evicted, least recently used first.

New weights make every cached K/V wrong (retire): unlocked nodes are freed at once, and the locked rest, which
running requests still read, leaves the tree as a retired tree that nothing matches and that is freed as those
requests let go. A request whose path is retired is stale: its K/V is never inserted into the live tree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from .base import MatchResult
from .memory_pool import ReqToTokenPool, TokenToKVPool

EMPTY = torch.empty(0, dtype=torch.int64, device="cpu")  # KV slot lists are host bookkeeping


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self.retired: list[TreeNode] = []  # roots of trees cached under earlier weights, still read
        self._evictable = 0
        self._protected = 0

    # -- lookups ------------------------------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        node, values = self.root, []
        now = next(self._clock)
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            matched = common_prefix_len(child.key, key)
            ends_inside = matched < len(child.key)
            if ends_inside:
                child = self._split(child, matched)
            child.last_access = now
            values.append(child.value)
            node, key = child, key[matched:]
            if ends_inside:
                break
        indices = torch.cat(values) if values else EMPTY
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add key -> value; returns how many leading tokens were already cached (their slots in `value`
        are now duplicates the caller must free)."""
        node, cached = self.root, 0
        now = next(self._clock)
        while key:
            child = node.children.get(key[0])
            if child is None:
                leaf = TreeNode(list(key), value.clone(), node)
                leaf.last_access = now
                node.children[key[0]] = leaf
                self._evictable += len(key)
                break
            matched = common_prefix_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            cached += matched
            node, key, value = child, key[matched:], value[matched:]
        return cached

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut child's run at `at`; the new upper node takes the first part and keeps child's lock count."""
        upper = TreeNode(child.key[:at], child.value[:at], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {child.key[at]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        return upper

    # -- locks --------------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:  # up to its tree's root, the live one or a retired one
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent
        if node is not self.root:
            self._prune_retired()

    # -- requests -----------------------------------------------------------------------------------------

    def cache_unfinished_req(self, req: Any) -> None:
        if self.is_stale(req):  # computed partly under other weights: it keeps its own K/V
            return
        tokens = req.token_ids_with_kv()
        slots = self.req_pool.req_to_token[req.req_pool_idx, : len(tokens)].clone()
        self._insert_and_free_duplicates(req, tokens, slots)
        match = self.match_prefix(tokens)
        # The request now reads the tree's copy of every token; re-point its table and move its lock down.
        self.req_pool.req_to_token[req.req_pool_idx, : len(match.indices)] = match.indices
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.indices, match.last_node

    def cache_finished_req(self, req: Any) -> None:
        tokens = req.token_ids_with_kv()
        slots = self.req_pool.req_to_token[req.req_pool_idx, : len(tokens)].clone()
        if self.is_stale(req):
            self.kv_pool.free(slots[len(req.prefix_indices) :])
        else:
            self._insert_and_free_duplicates(req, tokens, slots)
        self.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)

    def is_stale(self, req: Any) -> bool:
        """The request reads a retired tree: its K/V so far was computed under earlier weights."""
        node = req.last_node
        while node.parent is not None:
            node = node.parent
        return node is not self.root

    def _insert_and_free_duplicates(self, req: Any, tokens: list[int], slots: torch.Tensor) -> None:
        already = self.insert(tokens, slots)
        own_start = len(req.prefix_indices)
        if already > own_start:
            # Another request cached these tokens after this one matched: this request's copies are spare.
            self.kv_pool.free(slots[own_start:already])

    # -- eviction -----------------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.kv_pool.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def retire(self) -> int:
        """The weights changed: no K/V cached so far may be served again. Frees every unlocked node now and retires
        the locked rest (see the module docstring); returns how many tokens stay held by running requests."""
        self.evict(self._evictable)
        if self.root.children:
            self.retired.append(self.root)
            self.root = TreeNode([], EMPTY, None)
            self.root.lock_ref = 1
        self._prune_retired()
        return self._protected

    def _prune_retired(self) -> None:
        """Free the retired nodes nobody reads any more (a node's children are locked no more than it is)."""
        stack = list(self.retired)
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref == 0:
                    self._free_subtree(child)
                    del node.children[child.key[0]]
                else:
                    stack.append(child)
        self.retired = [root for root in self.retired if root.children]

    def _free_subtree(self, top: TreeNode) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            self.kv_pool.free(node.value)
            self._evictable -= len(node.key)
            stack.extend(node.children.values())

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def flush(self) -> bool:
        if self._protected:
            return False
        for node in self._nodes():
            if node is not self.root:
                self.kv_pool.free(node.value)
        self.reset()
        return True

    def owned_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes(every_tree=True) if n.parent is not None]
        return torch.cat(values) if values else EMPTY

    def _nodes(self, every_tree: bool = False) -> list[TreeNode]:
        stack, nodes = [self.root, *(self.retired if every_tree else [])], []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check_integrity(self) -> None:
        evictable = protected = 0
        for node in self._nodes(every_tree=True):
            if node.parent is None:
                continue
            assert len(node.key) == len(node.value) > 0, "a node's run and its slots differ in length"
            assert node.parent.children[node.key[0]] is node, "a node is not filed under its first token"
            assert node.lock_ref >= 0
            assert all(c.lock_ref <= node.lock_ref for c in node.children.values()), "a child outlocks its parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), "size counters drifted"
