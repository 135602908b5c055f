"""The Triton attention backend checked against torch_native, run on CPU under the Triton interpreter.

test_triton_attention.py runs this module in a fresh process with TRITON_INTERPRET=1: the interpreter is chosen
when triton is first imported, and other tests in a pytest process may already have imported it. triton is
imported only inside the checks, so the test module can import CHECKS (the names) without it. Prints one JSON
line: check name -> the failure, or null when the check passed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from furcate.runtime.attention.base import ForwardBatch
from furcate.runtime.attention.torch_native import TorchNativeAttention
from furcate.runtime.cache.memory_pool import ReqToTokenPool, TokenToKVPool

# Outputs are O(1): float32 to rounding, half types to about one unit in the last place of their output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Case:
    shapes: list[tuple[int, int]]  # (prefix_len, extend_len) per request
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    window: int | None = None
    split_tokens: int = 32  # small, so short test contexts still span several decode splits
    extend_blocks: tuple[int, int] | None = None  # (block_m, block_n) to call the extend kernel with directly


def layout(shapes: list[tuple[int, int]], pools: list[tuple[ReqToTokenPool, TokenToKVPool]],
           rng: random.Random) -> list[ForwardBatch]:
    """One batch per pool pair, all with the same shuffled KV slots (so kernels really gather) and request b in
    table row B-1-b (so the plan must follow req_pool_indices)."""
    total = sum(p + e for p, e in shapes)
    slots = list(range(1, pools[0][1].size + 1))
    rng.shuffle(slots)
    taken = torch.tensor(slots[:total])
    seqs = list(torch.split(taken, [p + e for p, e in shapes]))
    rows = torch.arange(len(shapes)).flip(0)
    batches = []
    for req_pool, kv_pool in pools:
        for row, seq in zip(rows.tolist(), seqs):
            req_pool.req_to_token[row, : len(seq)] = seq
        batches.append(ForwardBatch(
            input_ids=torch.zeros(sum(e for _, e in shapes), dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + e) for p, e in shapes]),
            out_cache_loc=torch.cat([seq[p:] for seq, (p, _) in zip(seqs, shapes)]),
            req_pool_indices=rows,
            prefix_lens=torch.tensor([p for p, _ in shapes]),
            extend_lens=torch.tensor([e for _, e in shapes]),
            seq_lens=torch.tensor([p + e for p, e in shapes]),
            req_to_token_pool=req_pool,
            token_to_kv_pool=kv_pool,
        ))
    return batches


def run_backend(backend, batch: ForwardBatch, q, k, v, scale: float, window: int | None) -> torch.Tensor:
    backend.init_forward_metadata(batch)
    backend.begin_forward(batch)
    return backend.forward(q, k, v, layer_id=0, scaling=scale, sliding_window=window)


def run_triton(case: Case, batch: ForwardBatch, q, k, v, scale: float) -> torch.Tensor:
    from furcate.runtime.attention.triton_backend import TritonAttention
    from furcate.runtime.attention.triton_kernels import extend_attention

    backend = TritonAttention(split_tokens=case.split_tokens)
    if case.extend_blocks is None:
        return run_backend(backend, batch, q, k, v, scale, case.window)
    backend.init_forward_metadata(batch)
    meta, pool = batch.attn_metadata, batch.token_to_kv_pool
    pool.set_kv(0, batch.out_cache_loc, k, v)
    block_m, block_n = case.extend_blocks
    out = extend_attention(q, pool.k_buffer[0], pool.v_buffer[0], meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                           meta.max_extend, scale, case.window, block_m=block_m, block_n=block_n)
    return out.view(q.shape[0], -1)


def compare(case: Case, seed: int = 0) -> ForwardBatch:
    """Triton in case.dtype against torch_native in float32 on the same (upcast) inputs and cached K/V; returns
    the batch Triton ran (its attn_metadata is the plan it ran with)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    context = max(p + e for p, e in case.shapes) + 1
    pools = [(ReqToTokenPool(len(case.shapes), context),
              TokenToKVPool(1024, 1, case.kv_heads, case.head_dim, dtype)) for dtype in (case.dtype, torch.float32)]
    pools[1][1].k_buffer[0].normal_()
    pools[1][1].v_buffer[0].normal_()
    pools[0][1].k_buffer[0].copy_(pools[1][1].k_buffer[0])
    pools[0][1].v_buffer[0].copy_(pools[1][1].v_buffer[0])
    batch, reference_batch = layout(case.shapes, pools, rng)
    tokens = int(batch.extend_lens.sum())
    q, k, v = (torch.randn(tokens, h, case.head_dim).to(case.dtype) for h in (case.heads, case.kv_heads, case.kv_heads))
    scale = case.head_dim**-0.5
    got = run_triton(case, batch, q, k, v, scale)
    # Upcast after the fact: the reference sees exactly the values the kernel read, rounding included.
    reference_pool = reference_batch.token_to_kv_pool
    reference_pool.k_buffer[0].copy_(batch.token_to_kv_pool.k_buffer[0])
    reference_pool.v_buffer[0].copy_(batch.token_to_kv_pool.v_buffer[0])
    expected = run_backend(TorchNativeAttention(), reference_batch, q.float(), k.float(), v.float(), scale,
                           case.window)
    assert got.dtype == case.dtype and got.shape == expected.shape
    error = (got.float() - expected).abs().max().item()
    assert error <= TOLERANCE[case.dtype], f"max error {error:.3g} > {TOLERANCE[case.dtype]}"
    return batch


def check_decode_splits_gqa() -> None:
    """Lengths 2 .. 151 in five splits: the short ones fill only the first (the rest are empty and must drop
    out of the merge), the longest all five."""
    from furcate.runtime.attention.triton_backend import num_kv_splits

    assert compare(Case([(1, 1), (4, 1), (40, 1), (150, 1)])).attn_metadata.num_kv_splits == 5
    assert num_kv_splits(1, 32) == 1 and num_kv_splits(10_000) == 8


def check_decode_mha_head_dim_80() -> None:
    """(0, 1): a one-token prompt, which the decode kernel takes too (one new token per request)."""
    compare(Case([(0, 1), (3, 1), (70, 1)], heads=4, kv_heads=4, head_dim=80, split_tokens=128))


def check_group_of_32_query_heads_head_dim_16() -> None:
    """More query heads per KV head than one decode program holds (16), and the smallest tl.dot head_dim."""
    compare(Case([(5, 1), (60, 1)], heads=32, kv_heads=1, head_dim=16))
    compare(Case([(5, 3), (0, 9)], heads=32, kv_heads=1, head_dim=16))


def check_decode_sliding_window() -> None:
    compare(Case([(1, 1), (15, 1), (16, 1), (100, 1)], window=16))


def check_decode_bfloat16() -> None:
    compare(Case([(1, 1), (40, 1), (90, 1)], dtype=torch.bfloat16))


def check_extend_without_prefix() -> None:
    """70 new tokens: two query blocks of 64 and two key blocks."""
    compare(Case([(0, 5), (0, 70), (0, 1)]))


def check_extend_with_prefix() -> None:
    compare(Case([(30, 10), (100, 3), (5, 70)]))


def check_mixed_decode_and_extend_mha_head_dim_80() -> None:
    compare(Case([(20, 1), (0, 12), (33, 1), (7, 9)], heads=4, kv_heads=4, head_dim=80))


def check_extend_sliding_window() -> None:
    compare(Case([(40, 20), (0, 30), (3, 1)], window=8))


def check_extend_small_blocks_sliding_window() -> None:
    """Blocks of 16: query blocks whose window starts keys several blocks in, and key blocks past the causal
    edge of some rows of the query block."""
    compare(Case([(40, 37), (0, 50), (9, 2)], heads=4, window=20, extend_blocks=(16, 16)))
    compare(Case([(25, 40), (0, 33)], heads=4, extend_blocks=(16, 16)))


def check_extend_query_blocks_taller_than_key_blocks() -> None:
    """block_m > block_n (the shape large GPUs favour) with a window: a block's last queries see no key of its
    first key block, and such rows must not turn into NaN."""
    compare(Case([(40, 37), (0, 50)], heads=4, window=10, extend_blocks=(32, 16)))


def check_extend_bfloat16_head_dim_80() -> None:
    compare(Case([(10, 20), (0, 7), (33, 1)], head_dim=80, dtype=torch.bfloat16))


# Per request, its (prefix_len, extend_len) in each step, None when it sits the step out: a prefill, a decode
# step, then a mixed batch (two decodes ... an extend over a cached prefix, a new prompt).
MODEL_STEPS = [
    [(0, 9), (0, 30), None],
    [(9, 1), (30, 1), None],
    [(10, 1), (31, 4), (0, 5)],
]
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def model_batches(steps: list, pools: tuple[ReqToTokenPool, TokenToKVPool]) -> list[ForwardBatch]:
    """The steps as forward batches over one pool pair; request r owns table row r and consecutive slots."""
    req_pool, kv_pool = pools
    lengths = [max(p + e for p, e in filter(None, column)) for column in zip(*steps)]
    for row, start in enumerate(torch.cumsum(torch.tensor([0] + lengths[:-1]), 0).tolist()):
        req_pool.req_to_token[row, : lengths[row]] = torch.arange(start + 1, start + 1 + lengths[row])
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in steps:
        rows = [r for r, shape in enumerate(step) if shape]
        shapes = [step[r] for r in rows]
        batches.append(ForwardBatch(
            input_ids=torch.randint(3, 1000, (sum(e for _, e in shapes),), generator=generator),
            positions=torch.cat([torch.arange(p, p + e) for p, e in shapes]),
            out_cache_loc=torch.cat([req_pool.req_to_token[r, p : p + e] for r, (p, e) in zip(rows, shapes)]),
            req_pool_indices=torch.tensor(rows),
            prefix_lens=torch.tensor([p for p, _ in shapes]),
            extend_lens=torch.tensor([e for _, e in shapes]),
            seq_lens=torch.tensor([p + e for p, e in shapes]),
            req_to_token_pool=req_pool,
            token_to_kv_pool=kv_pool,
        ))
    return batches


def compare_model_logits(arch: str) -> None:
    """A tiny random model's logits of every token of every step, with each backend over its own pools."""
    from furcate.runtime.attention.triton_backend import TritonAttention
    from furcate.runtime.model.decoder import DecoderForCausalLM
    from furcate.runtime.model.families import FAMILIES
    from tiny_models import CONFIGS

    torch.manual_seed(0)
    config = CONFIGS[arch]()
    model = DecoderForCausalLM(config, FAMILIES[ARCHITECTURES[arch]]).eval()
    attn = model.model.layers[0].self_attn
    logits = {}
    for backend in (TorchNativeAttention(), TritonAttention()):
        pools = (ReqToTokenPool(3, 64), TokenToKVPool(256, config.num_hidden_layers, attn.num_kv_heads,
                                                      attn.head_dim, torch.float32))
        logits[type(backend)] = []
        for batch in model_batches(MODEL_STEPS, pools):
            backend.init_forward_metadata(batch)
            logits[type(backend)].append(model.compute_logits(model(batch, backend)))
    for expected, got in zip(*logits.values()):
        error = (got - expected).abs().max().item()
        assert error <= 2e-5, f"max logit error {error:.3g}"


def check_mixed_float16_sliding_window() -> None:
    compare(Case([(50, 1), (0, 20), (12, 6)], dtype=torch.float16, window=10))
    compare(Case([(50, 1), (3, 1)], dtype=torch.float16, window=10))


def check_tiny_llama_logits() -> None:
    compare_model_logits("llama")


def check_tiny_mistral_sliding_window_logits() -> None:
    """Window 24, crossed by the 30-token prompt and every later step of that request."""
    compare_model_logits("mistral")


CHECKS: dict[str, Callable[[], None]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run(names: list[str]) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for name in names:
        print(f"check {name}", file=sys.stderr, flush=True)  # names the check if a kernel crashes the process
        try:
            CHECKS[name]()
            results[name] = None
        except Exception:  # noqa: BLE001 - each check's traceback is its result; the caller asserts on them
            results[name] = traceback.format_exc()
    return results


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: these checks run the Triton kernels on CPU")
    print(json.dumps(run(sys.argv[1:] or list(CHECKS))))


if __name__ == "__main__":
    main()
