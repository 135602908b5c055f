"""Radix cache and chunk cache on CPU, without a model: matching, splitting, locks, LRU eviction, accounting."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from furcate.runtime.cache.memory_pool import ReqToTokenPool, TokenToKVPool
from furcate.runtime.cache.radix_cache import RadixCache

POOL = 512


def make_cache() -> tuple[RadixCache, TokenToKVPool]:
    kv_pool = TokenToKVPool(POOL, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return RadixCache(ReqToTokenPool(4, 64), kv_pool), kv_pool


def insert(cache: RadixCache, kv_pool: TokenToKVPool, key: list[int]) -> torch.Tensor:
    """Insert as a request would: fresh slots for the whole key, spare ones freed."""
    slots = kv_pool.alloc(len(key))
    already = cache.insert(key, slots)
    kv_pool.free(slots[:already])
    return slots


def accounted(cache: RadixCache, kv_pool: TokenToKVPool) -> int:
    return kv_pool.available_size() + cache.evictable_size() + cache.protected_size()


def test_match_splits_a_node_and_returns_the_first_inserters_slots():
    cache, kv_pool = make_cache()
    first = insert(cache, kv_pool, [1, 2, 3, 4, 5])
    insert(cache, kv_pool, [1, 2, 3, 9])
    match = cache.match_prefix([1, 2, 3, 4, 7])
    assert match.indices.tolist() == first[:4].tolist()
    assert cache.match_prefix([8]).indices.numel() == 0
    assert cache.evictable_size() == 6  # 1 2 3 | 4 5 | 9
    cache.check_integrity()
    assert accounted(cache, kv_pool) == POOL


def test_locked_paths_survive_eviction_and_lru_goes_first():
    cache, kv_pool = make_cache()
    insert(cache, kv_pool, [1, 2, 3])
    insert(cache, kv_pool, [4, 5, 6])
    insert(cache, kv_pool, [7, 8])
    cache.match_prefix([4, 5, 6])  # touch: [1 2 3] is now least recently used
    freed = cache.evict(3)
    assert freed == 3 and cache.match_prefix([1, 2, 3]).indices.numel() == 0
    locked = cache.match_prefix([4, 5, 6]).last_node
    cache.inc_lock_ref(locked)
    assert cache.protected_size() == 3
    assert cache.evict(100) == 2
    assert cache.match_prefix([4, 5, 6]).indices.numel() == 3
    assert not cache.flush(), "flush must refuse while a request holds a lock"
    cache.dec_lock_ref(locked)
    assert cache.flush() and kv_pool.available_size() == POOL
    cache.check_integrity()


def test_evicting_a_leaf_exposes_its_parent():
    cache, kv_pool = make_cache()
    insert(cache, kv_pool, [1, 2, 3, 4])
    insert(cache, kv_pool, [1, 2, 5])
    assert cache.evict(7) == 5
    assert kv_pool.available_size() == POOL
    cache.check_integrity()


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(sequences, st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_matches_agree_with_a_naive_twin(keys, probe):
    """The naive twin: the longest common prefix with any inserted key, by brute force."""
    cache, kv_pool = make_cache()
    slots_of: dict[tuple[int, ...], int] = {}
    for key in keys:
        slots = insert(cache, kv_pool, key)
        for i in range(len(key)):
            slots_of.setdefault(tuple(key[: i + 1]), int(slots[i]))
    naive = max(len(_lcp(key, probe)) for key in keys)
    match = cache.match_prefix(probe)
    assert match.indices.tolist() == [slots_of[tuple(probe[: i + 1])] for i in range(naive)]
    cache.check_integrity()
    assert accounted(cache, kv_pool) == POOL


@settings(max_examples=100, deadline=None)
@given(sequences, st.lists(st.booleans(), min_size=25, max_size=25), st.integers(0, 40))
def test_random_locks_and_evictions_keep_every_slot_accounted(keys, lock_flags, to_evict):
    cache, kv_pool = make_cache()
    locked = []
    for key, lock in zip(keys, lock_flags):
        insert(cache, kv_pool, key)
        if lock:
            node = cache.match_prefix(key).last_node
            cache.inc_lock_ref(node)
            locked.append((key, node))
    cache.evict(to_evict)
    cache.check_integrity()
    assert accounted(cache, kv_pool) == POOL
    for key, _ in locked:
        assert cache.match_prefix(key).indices.numel() == len(key), "a locked prefix was evicted"
    for _, node in locked:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(POOL)
    assert kv_pool.available_size() == POOL


def _lcp(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class NaiveTwin:
    """Every cached token prefix -> its KV slot, kept in a dict; matching is a brute-force longest lookup."""

    def __init__(self) -> None:
        self.slot_of: dict[tuple[int, ...], int] = {}

    def insert(self, key: list[int], slots: torch.Tensor) -> None:
        for i in range(len(key)):
            self.slot_of.setdefault(tuple(key[: i + 1]), int(slots[i]))

    def forget(self, freed: set[int]) -> None:
        self.slot_of = {k: v for k, v in self.slot_of.items() if v not in freed}

    def match(self, key: list[int]) -> list[int]:
        slots = []
        for i in range(len(key)):
            slot = self.slot_of.get(tuple(key[: i + 1]))
            if slot is None:
                break
            slots.append(slot)
        return slots


operations = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
              st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(0, 30)),
    min_size=1, max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_random_operation_sequences_against_the_naive_twin(ops):
    cache, kv_pool = make_cache()
    twin = NaiveTwin()
    locks: list[tuple[list[int], object]] = []
    for op, key, amount in ops:
        if op == "insert":
            slots = kv_pool.alloc(len(key))
            already = cache.insert(key, slots)
            kv_pool.free(slots[:already])
            twin.insert(key, slots)
        elif op == "match":
            assert cache.match_prefix(key).indices.tolist() == twin.match(key)
        elif op == "lock":
            match = cache.match_prefix(key)
            if match.indices.numel():
                cache.inc_lock_ref(match.last_node)
                locks.append((key[: match.indices.numel()], match.last_node))
        elif op == "unlock" and locks:
            _, node = locks.pop(amount % len(locks))
            cache.dec_lock_ref(node)
        elif op == "evict":
            free_before = set(kv_pool._free)
            cache.evict(amount)
            twin.forget(set(kv_pool._free) - free_before)
            for locked_key, _ in locks:
                assert cache.match_prefix(locked_key).indices.numel() == len(locked_key), "evicted a locked node"
        cache.check_integrity()
        assert accounted(cache, kv_pool) == POOL, "sizes do not add up"


class StaleReq:
    """The fields of a request the cache reads."""

    def __init__(self, cache: RadixCache, tokens: list[int], kv_pool: TokenToKVPool) -> None:
        match = cache.match_prefix(tokens)
        self.prefix_indices, self.last_node = match.indices, match.last_node
        self.req_pool_idx = cache.req_pool.alloc()
        own = kv_pool.alloc(len(tokens) - len(match.indices))
        cache.req_pool.req_to_token[self.req_pool_idx, : len(tokens)] = torch.cat([match.indices, own])
        cache.inc_lock_ref(self.last_node)
        self.tokens = tokens

    def token_ids_with_kv(self) -> list[int]:
        return self.tokens


def test_retire_frees_unlocked_kv_and_never_serves_a_running_requests_old_kv():
    cache, kv_pool = make_cache()
    insert(cache, kv_pool, [1, 2, 3, 4])
    insert(cache, kv_pool, [7, 8, 9])
    reader = StaleReq(cache, [1, 2, 3, 4, 5, 6], kv_pool)  # reads [1 2 3 4] from the tree, owns 5 6
    assert cache.retire() == 4, "only the running request's prefix stays held"
    assert cache.evictable_size() == 0 and cache.retired
    assert cache.match_prefix([1, 2, 3, 4]).indices.numel() == 0, "K/V of the old weights was matched"
    assert cache.is_stale(reader)
    cache.cache_unfinished_req(reader)  # a chunk boundary: nothing of it may enter the live tree
    assert cache.match_prefix([1, 2]).indices.numel() == 0
    fresh = insert(cache, kv_pool, [1, 2, 3])  # computed under the new weights
    cache.check_integrity()
    cache.cache_finished_req(reader)
    assert not cache.retired and cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == fresh.tolist()
    cache.check_integrity()
    assert accounted(cache, kv_pool) == POOL, "the retired tree's slots must all come back"
    assert cache.flush() and kv_pool.available_size() == POOL
