"""CUDA-graph shape logic on CPU: the capture ladder, which captured size a batch runs at, and padding a decode
batch so that the real requests' outputs are unchanged."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from furcate.runtime.attention.torch_native import TorchNativeAttention
from furcate.runtime.config import EngineArgs
from furcate.runtime.executor.cuda_graph import (
    batch_size_ladder,
    capture_batch_sizes,
    pad_decode_batch,
    padded_batch_size,
)
from test_flashinfer_plan import HEAD_DIM, HEADS, KV_HEADS, make_batch


def test_ladder_is_powers_of_two_to_eight_then_steps_of_eight_to_256():
    sizes = capture_batch_sizes(EngineArgs(device="cuda", max_running_requests=1000))
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-2:] == [248, 256] and len(sizes) == 4 + 31
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


@pytest.mark.parametrize("max_running, max_bs, expected_tail", [
    (128, None, [120, 128]),
    (100, None, [96, 100]),  # the largest possible batch gets its own graph
    (5, None, [1, 2, 4, 5]),
    (1, None, [1]),
    (1000, 32, [24, 32]),
    (1000, 300, [296, 300]),  # an explicit cap above 256 keeps the steps of 8
])
def test_ladder_is_capped_by_running_requests_and_cuda_graph_max_bs(max_running, max_bs, expected_tail):
    args = EngineArgs(device="cuda", max_running_requests=max_running, cuda_graph_max_bs=max_bs)
    sizes = capture_batch_sizes(args)
    assert sizes[-len(expected_tail):] == expected_tail and sizes == sorted(set(sizes))


def test_nothing_is_captured_off_cuda_or_when_disabled():
    assert capture_batch_sizes(EngineArgs()) == []
    assert capture_batch_sizes(EngineArgs(device="cuda", disable_cuda_graph=True)) == []
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineArgs(cuda_graph_max_bs=0)


def test_a_batch_runs_at_the_next_captured_size_or_eagerly_above_the_largest():
    sizes = batch_size_ladder(100)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 8, 9, 17, 96, 97, 100)] == [1, 4, 8, 16, 24, 96, 100, 100]
    assert padded_batch_size(sizes, 101) is None
    assert padded_batch_size([], 1) is None


def _forward(batch, q, k, v) -> torch.Tensor:
    backend = TorchNativeAttention()
    backend.init_forward_metadata(batch)
    backend.begin_forward(batch)
    return backend.forward(q, k, v, layer_id=0, scaling=0.3, sliding_window=None)


@pytest.mark.parametrize("seed, real", [(0, 1), (1, 3), (2, 5), (3, 6), (4, 4)])
def test_padding_a_decode_batch_leaves_the_real_rows_outputs_and_live_kv_alone(seed, real):
    rng = random.Random(seed)
    batch = make_batch(rng, 1, [(rng.randint(1, 60), 1) for _ in range(real)])
    size = padded_batch_size(batch_size_ladder(8), real)
    torch.manual_seed(seed)
    q, k, v = (torch.randn(real, heads, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))
    expected = _forward(batch, q, k, v)
    live_k = batch.token_to_kv_pool.k_buffer[0][1:].clone()

    padded = pad_decode_batch(batch, size)
    extra = size - real
    assert extra == {1: 0, 3: 1, 5: 3, 6: 2, 4: 0}[real]
    assert padded.batch_size == size and padded.attn_metadata is None
    assert padded.out_cache_loc[real:].tolist() == [0] * extra
    assert padded.seq_lens[real:].tolist() == [1] * extra
    assert torch.equal(padded.seq_lens, padded.prefix_lens + padded.extend_lens)
    noise = [torch.randn(extra, *t.shape[1:]) for t in (q, k, v)]
    out = _forward(padded, *(torch.cat([t, n]) for t, n in zip((q, k, v), noise)))
    assert out.shape[0] == size
    # The runner reads logits at the real requests' rows (ScheduleBatch.logit_ranges): padding rows come after them.
    real_rows = torch.arange(real)
    assert torch.allclose(out[real_rows], expected, atol=1e-5)
    assert torch.equal(batch.token_to_kv_pool.k_buffer[0][1:], live_k)  # padding wrote only slot 0


def test_only_decode_batches_are_padded_and_never_shrunk():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="only decode"):
        pad_decode_batch(make_batch(rng, 1, [(0, 5)]), 8)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_batch(make_batch(rng, 1, [(3, 1), (4, 1)]), 1)


def test_triton_plans_a_captured_decode_batch_into_fixed_buffers():
    """A graph replays the addresses it captured: every decode batch of a size is planned into the same buffers,
    with the plan init_forward_metadata makes for it, at the fixed split count."""
    pytest.importorskip("triton")
    from furcate.runtime.attention.triton_backend import MAX_KV_SPLITS, TritonAttention

    backend = TritonAttention()
    backend.init_cuda_graph_state(max_bs=8, max_context_len=256, device="cpu")
    rng = random.Random(0)
    addresses = set()
    for shapes in ([(5, 1), (40, 1), (1, 1), (17, 1)], [(60, 1), (2, 1), (0, 1), (33, 1)]):
        batch = pad_decode_batch(make_batch(rng, 1, shapes), 4)
        expected = eager_metadata(TritonAttention(), batch)
        backend.init_forward_metadata_graph(batch)
        planned = batch.attn_metadata
        assert torch.equal(planned.kv_indptr, expected.kv_indptr)
        assert torch.equal(planned.kv_indices[: len(expected.kv_indices)], expected.kv_indices)
        assert planned.decode and planned.num_kv_splits == MAX_KV_SPLITS
        addresses.add((planned.kv_indptr.data_ptr(), planned.kv_indices.data_ptr(), planned.qo_indptr.data_ptr()))
    assert len(addresses) == 1
    small = TritonAttention()
    small.init_cuda_graph_state(max_bs=2, max_context_len=256, device="cpu")
    with pytest.raises(ValueError, match="exceeds the 2"):
        small.init_forward_metadata_graph(make_batch(rng, 1, [(3, 1)] * 3))
    with pytest.raises(ValueError, match="decode batches only"):
        backend.init_forward_metadata_graph(make_batch(rng, 1, [(3, 2)]))


def eager_metadata(backend, batch):
    fresh = dataclasses.replace(batch, attn_metadata=None)
    backend.init_forward_metadata(fresh)
    return fresh.attn_metadata
