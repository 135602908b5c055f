"""The paged attention kernel (paged_attention.c) against SDPA over gathered K/V, for decode and prefill."""

from __future__ import annotations

import functools
import os
import platform

import pytest
import torch
import torch.nn.functional as F

from furcate.runtime.attention import paged_table
from furcate.runtime.attention.base import ModelAttention
from furcate.runtime.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason=f"kernel: {paged_attention.library()}")

POOL = 3000


@pytest.fixture(params=["ctypes", "op", "avx2"])
def attend(request):
    """The kernel as eager forwards call it (ctypes) and as a compiled step does (the op furcate::paged_attention,
    whose CPU kernel is paged_attention_op.cpp's where it builds): the same results and the same refusals; and as it
    builds on a CPU without AVX-512 (8-float vectors)."""
    if request.param == "avx2":
        return request.getfixturevalue("avx2_build")
    return paged_attention.attention if request.param == "ctypes" else paged_attention.attention_op


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernel built for AVX2 (as on AMD Zen 2/3 or Intel client chips), on any x86 CPU that has AVX2."""
    if platform.machine() not in ("x86_64", "AMD64") or not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("not an x86 CPU with AVX2")
    os.environ["FURCATE_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    try:
        lib = paged_attention.load(("-mno-avx512f",))
    finally:
        del os.environ["FURCATE_CACHE"]
    return functools.partial(paged_attention.attention, lib=lib)


@pytest.fixture(scope="module")
def float_build(tmp_path_factory):
    """The kernel as it builds on a CPU without AVX512-BF16: bfloat16 pools widened to float32 throughout."""
    os.environ["FURCATE_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    try:
        lib = paged_attention.load(("-mno-avx512bf16",))
    finally:
        del os.environ["FURCATE_CACHE"]
    assert not paged_attention.bfloat16_products(lib)
    return functools.partial(paged_attention.attention, lib=lib)


def reference(q, k_pool, v_pool, kv_index, spans, scale):
    """Causal SDPA in float32 over each request's gathered slots, query heads grouped under their KV head."""
    heads, dim = q.shape[1:]
    kv_heads = k_pool.shape[1]
    out = torch.empty(q.shape)
    for b, (first, count, cached) in enumerate(spans.t().tolist()):
        slots = kv_index[b, : cached + count]
        keys, values = (pool[slots].transpose(0, 1).float() for pool in (k_pool, v_pool))  # [Hkv, S, D]
        queries = q[first : first + count].float().view(count, kv_heads, heads // kv_heads, dim)
        queries = queries.permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)  # rows: (group, token)
        sees = torch.arange(cached + count)[None, :] <= (cached + torch.arange(count))[:, None]
        mask = sees.repeat(heads // kv_heads, 1)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        out[first : first + count] = attended.view(kv_heads, heads // kv_heads, count, dim).permute(2, 0, 1, 3) \
            .reshape(count, heads, dim)
    return out


def case(new_tokens, cached, heads, kv_heads, dim, query_scale=1.0, seed=0):
    """Requests with these new and cached token counts, their slots spread over a random pool."""
    generator = torch.Generator().manual_seed(seed)
    k_pool, v_pool = (torch.randn(POOL, kv_heads, dim, generator=generator) for _ in range(2))
    q = torch.randn(sum(new_tokens), heads, dim, generator=generator) * query_scale
    length = max(n + c for n, c in zip(new_tokens, cached)) + 3  # a padded table, as the engine plans it
    kv_index = torch.randint(1, POOL, (len(new_tokens), length), generator=generator)
    counts = torch.tensor(new_tokens)
    spans = paged_attention.spans(torch.cumsum(counts, 0) - counts, counts, torch.tensor(cached))
    return q, k_pool, v_pool, kv_index, spans


def decode(batch, context, seed=0):
    """A decode batch: one new token a request, after context - 1 cached (request 0's is the longest)."""
    contexts = torch.randint(1, context + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    contexts[0] = context
    return [1] * batch, (contexts - 1).tolist()


@pytest.mark.parametrize("new_tokens, cached, heads, kv_heads, dim", [
    (*decode(1, 1), 9, 3, 64),  # one key
    (*decode(1, 64), 9, 3, 64), (*decode(2, 65), 9, 3, 64),  # a block exactly, and one key past it
    (*decode(32, 300), 9, 3, 64),  # the default model's shape at a serving batch
    (*decode(3, 200), 32, 8, 128), (*decode(2, 130), 16, 1, 256), (*decode(4, 70), 4, 4, 16),
    (*decode(8, 40), 128, 16, 16),  # more query rows than a work item holds: two items a request
    ([100], [0], 9, 3, 64),  # a prompt's prefill: causal within it
    ([37, 5, 16, 1], [0, 130, 64, 7], 9, 3, 64),  # prefills after cached prefixes, beside a decode
    ([20, 3], [10, 0], 32, 2, 32),  # 16 queries per KV head: tiles of 3 tokens
])
def test_matches_causal_sdpa_over_gathered_keys(attend, new_tokens, cached, heads, kv_heads, dim):
    q, k_pool, v_pool, kv_index, spans = case(new_tokens, cached, heads, kv_heads, dim)
    out = attend(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5), rtol=2e-5,
                               atol=2e-5)


BFLOAT16_CASES = [
    (*decode(1, 64), 9, 3, 64), (*decode(32, 300), 9, 3, 64), (*decode(3, 200), 32, 8, 128),
    (*decode(3, 65), 4, 2, 16),  # a head dimension the bfloat16 products do not take: the float path
    ([37, 5, 16, 1], [0, 130, 64, 7], 9, 3, 64), ([20, 3], [10, 0], 32, 2, 32),
]


def bfloat16_case(new_tokens, cached, heads, kv_heads, dim):
    return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t
                 for t in case(new_tokens, cached, heads, kv_heads, dim))


@pytest.fixture(params=["engine's build", "widened"])
def bfloat16_build(request, attend, float_build):
    """The engine's build (bfloat16 products where the CPU has AVX512-BF16) and the float path's."""
    return attend if request.param == "engine's build" else float_build


@pytest.mark.parametrize("new_tokens, cached, heads, kv_heads, dim", BFLOAT16_CASES)
def test_bfloat16_is_float32_attention_rounded_once(bfloat16_build, new_tokens, cached, heads, kv_heads, dim):
    """bfloat16 queries and pool: the float32 result over the same (bfloat16) numbers, rounded to bfloat16 at the
    end, as torch rounds (at most one bfloat16 step from it where float32 noise meets a rounding boundary). Widened
    to float32, or multiplied as bfloat16 with each softmax weight split into two bfloat16 parts: both are float32
    attention up to the order of float32 sums."""
    q, k_pool, v_pool, kv_index, spans = bfloat16_case(new_tokens, cached, heads, kv_heads, dim)
    out = bfloat16_build(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-5)
    assert (out.float() == expected.to(torch.bfloat16).float()).float().mean() > 0.99


def random_prefills(seed):
    """1-4 requests of 2-50 new tokens after 0-150 cached ones, at a head shape of each group size."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = [(9, 3, 64), (8, 8, 64), (16, 4, 128), (32, 2, 32)][seed % 4]
    batch = int(torch.randint(1, 5, (1,), generator=generator))
    new_tokens = torch.randint(2, 51, (batch,), generator=generator).tolist()
    return new_tokens, torch.randint(0, 151, (batch,), generator=generator).tolist(), heads, kv_heads, dim


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_prefill_tiles(bfloat16_build, seed):
    """Tiles of a request's new tokens (where the CPU has AVX512-BF16, scored many rows at once with their query
    pairs transposed): partial vectors of rows, several KV heads an item, blocks cut by the causal mask and by a
    cached prefix, all float32 attention rounded once, as the rows' own path is."""
    new_tokens, cached, heads, kv_heads, dim = random_prefills(seed)
    q, k_pool, v_pool, kv_index, spans = bfloat16_case(new_tokens, cached, heads, kv_heads, dim)
    out = bfloat16_build(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    expected = reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5).to(torch.bfloat16).float()
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-5)
    assert (out.float() == expected).float().mean() > 0.99


def shared_prefix_case(groups, shared, heads, kv_heads, dim, dtype=torch.float32):
    """Requests in groups (each a list of (new, cached) token counts) whose first `shared` cached slots are their
    group's, the groups' requests interleaved in the batch, as forks of several programs decode side by side."""
    members = [(g, n, c) for i in range(max(map(len, groups))) for g, group in enumerate(groups) if i < len(group)
               for n, c in [group[i]]]
    q, k_pool, v_pool, kv_index, spans = case([n for _, n, _ in members], [c for _, _, c in members], heads,
                                              kv_heads, dim)
    prefixes = torch.randperm(POOL - 1, generator=torch.Generator().manual_seed(1))[: len(groups) * shared] + 1
    for b, (g, _, _) in enumerate(members):
        kv_index[b, :shared] = prefixes[g * shared:(g + 1) * shared]
    floating = (q, k_pool, v_pool) if dtype == torch.float32 else (t.to(dtype) for t in (q, k_pool, v_pool))
    return *floating, kv_index, spans


def each_alone(attend, q, k_pool, v_pool, kv_index, spans, scale):
    """Every request of the batch attended in a batch of its own."""
    outs = []
    for b, (first, count, cached) in enumerate(spans.t().tolist()):
        alone = paged_attention.spans(torch.tensor([0]), torch.tensor([count]), torch.tensor([cached]))
        outs.append(attend(q[first:first + count], k_pool, v_pool, kv_index[b:b + 1], alone, scale))
    return torch.cat(outs)


SHARED_PREFIX_CASES = [
    # four programs' forks decoding after 512 shared tokens and suffixes of their own (one exactly at the prefix)
    ([[(1, 512 + s) for s in (0, 3, 40, 70, 100, 1, 64, 9)]] * 4, 512, 9, 3, 64),
    # more members than one work item's rows, prefill tokens among them, a prefix not a multiple of BLOCK
    ([[(1, 200), (5, 150), (16, 140), (1, 139), (2, 300), (1, 160), (3, 170)], [(1, 100)] * 3], 139, 9, 3, 64),
    ([[(1, 90)] * 5, [(1, 70), (1, 63)]], 63, 8, 2, 32),  # fewer shared slots than a block: no group
    ([[(1, 300)] * 6], 256, 32, 8, 128),
]


@pytest.mark.parametrize("groups, shared, heads, kv_heads, dim", SHARED_PREFIX_CASES)
def test_requests_sharing_a_prefix_get_what_each_gets_alone(attend, groups, shared, heads, kv_heads, dim):
    """Requests whose tables start with the same cached slots read those keys together: their outputs are the
    ones each gets in a batch of its own, to the bit, and SDPA's."""
    q, k_pool, v_pool, kv_index, spans = shared_prefix_case(groups, shared, heads, kv_heads, dim)
    out = attend(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    assert torch.equal(out, each_alone(attend, q, k_pool, v_pool, kv_index, spans, dim**-0.5))
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("groups, shared, heads, kv_heads, dim", SHARED_PREFIX_CASES)
def test_bfloat16_requests_sharing_a_prefix_get_what_each_gets_alone(bfloat16_build, groups, shared, heads,
                                                                      kv_heads, dim):
    """The same in bfloat16, with bfloat16 products and widened to float32 (CPUs without AVX512-BF16)."""
    q, k_pool, v_pool, kv_index, spans = shared_prefix_case(groups, shared, heads, kv_heads, dim, torch.bfloat16)
    out = bfloat16_build(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    assert torch.equal(out, each_alone(bfloat16_build, q, k_pool, v_pool, kv_index, spans, dim**-0.5))
    expected = reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5).to(torch.bfloat16).float()
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_of_groups_get_what_each_gets_alone(attend, seed):
    """Batches drawn at random: groups of up to 20 requests, each after a shared prefix of 0-300 slots, with 1-20 new
    tokens after their own cached ones (so groups split where rows run out, and members cache less than the
    prefix), under three head layouts."""
    rng = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=rng))  # noqa: E731
    heads, kv_heads, dim = [(9, 3, 64), (8, 8, 32), (16, 2, 16)][seed % 3]
    shared = draw(0, 300)
    groups = [[(draw(1, 1) if draw(0, 3) else draw(2, 20), shared + draw(-20, 40)) for _ in range(draw(1, 20))]
              for _ in range(draw(1, 4))]
    groups = [[(n, max(c, 0)) for n, c in group] for group in groups]
    q, k_pool, v_pool, kv_index, spans = shared_prefix_case(groups, shared, heads, kv_heads, dim)
    out = attend(q, k_pool, v_pool, kv_index, spans, dim**-0.5)
    assert torch.equal(out, each_alone(attend, q, k_pool, v_pool, kv_index, spans, dim**-0.5))
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, kv_index, spans, dim**-0.5), rtol=2e-5, atol=2e-5)


def test_a_shared_prefix_with_slots_outside_the_pool_reads_slot_zero(attend):
    """A corrupt slot inside a shared prefix, in every table of the group, reads slot 0 there too."""
    q, k_pool, v_pool, kv_index, spans = shared_prefix_case([[(1, 100)] * 4], 70, 4, 2, 16)
    bad = kv_index.clone()
    bad[:, 5], bad[:, 40] = POOL + 10**9, -5
    fixed = bad.clone()
    fixed[:, 5], fixed[:, 40] = 0, 0
    torch.testing.assert_close(attend(q, k_pool, v_pool, bad, spans, 0.25),
                               attend(q, k_pool, v_pool, fixed, spans, 0.25))


@pytest.mark.parametrize("dim", [16, 64])  # the float path; bfloat16 products where the CPU has them
def test_bfloat16_nan_stays_nan(attend, dim):
    q, k_pool, v_pool, kv_index, spans = bfloat16_case([1], [8], 4, 2, dim)
    v_pool[kv_index[0, 3], 1, 5] = float("nan")  # one value of the second KV head: its queries' dimension 5
    out = attend(q, k_pool, v_pool, kv_index, spans, 0.25)
    assert out[0, 2:, 5].isnan().all() and not out[0, :2].isnan().any() and not out[0, 2:, :5].isnan().any()


def test_large_scores_stay_finite(attend):
    """Scores in the hundreds: the running maximum keeps every exponential in range (a score's last bit, ~3e-5
    there, moves the weights more than at ordinary scale: a looser tolerance)."""
    q, k_pool, v_pool, kv_index, spans = case([1, 1, 40], [499, 200, 60], 8, 2, 64, query_scale=400.0)
    out = attend(q, k_pool, v_pool, kv_index, spans, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, kv_index, spans, 0.125), rtol=1e-3, atol=1e-3)


def test_slots_outside_the_pool_read_slot_zero(attend):
    """A corrupt slot table never reads past the pool: such slots read the reserved slot 0."""
    q, k_pool, v_pool, kv_index, spans = case([1, 4], [9, 5], 4, 2, 16)
    bad = kv_index.clone()
    bad[0, 3], bad[1, 0] = POOL + 10**9, -5
    fixed = bad.clone()
    fixed[0, 3], fixed[1, 0] = 0, 0
    torch.testing.assert_close(attend(q, k_pool, v_pool, bad, spans, 0.25),
                               attend(q, k_pool, v_pool, fixed, spans, 0.25))


def test_spans_past_the_table_are_refused(attend):
    q, k_pool, v_pool, kv_index, spans = case([2, 3], [4, 1], 4, 2, 16)
    for row, value in ((2, kv_index.shape[1]), (1, 0), (2, -1)):  # cached past the table; no new tokens; < 0
        wrong = spans.clone()
        wrong[row, 1] = value
        with pytest.raises(ValueError, match="past its slot table"):
            attend(q, k_pool, v_pool, kv_index, wrong, 0.25)


def test_shapes_beyond_its_limits_are_refused(attend):
    q, k_pool, v_pool, kv_index, spans = case([1], [4], 4, 2, 24)  # 24: not a multiple of 16
    assert not paged_attention.supports(4, 2, 24, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        attend(q, k_pool, v_pool, kv_index, spans, 0.2)
    assert not paged_attention.supports(34, 2, 64, torch.float32)  # 17 query heads per KV head
    q, k_pool, v_pool, kv_index, spans = case([1], [4], 4, 2, 16)
    assert not paged_attention.supports(4, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="runs float32 or bfloat16"):
        attend(q.half(), k_pool.half(), v_pool.half(), kv_index, spans, 0.2)
    with pytest.raises(ValueError, match="runs float32 or bfloat16"):  # queries and pool of two dtypes
        attend(q, k_pool.bfloat16(), v_pool.bfloat16(), kv_index, spans, 0.2)


@pytest.mark.parametrize("change, serves", [
    ({}, True), ({"windows": frozenset({None, 4096})}, False), ({"logit_cap": 50.0}, False),
    ({"num_kv_heads": None}, False), ({"head_dim": 24}, False), ({"dtype": torch.bfloat16}, True),
    ({"dtype": torch.float16}, False),
])
def test_models_it_serves(change, serves):
    shape = dict(num_heads=8, head_dim=64, scaling=0.125, dtype=torch.float32, num_kv_heads=2)
    assert paged_table.serves(ModelAttention(**{**shape, **change})) is serves
    assert not paged_table.serves(None)
