"""enable_torch_compile: decode runs as one compiled graph per batch-size class and keeps greedy output exact."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import EXACT, NO_GRAMMAR, assert_pool_free, engine_starting, engines_side_by_side
from furcate import Engine
from furcate.runtime.attention.base import ForwardBatch
from furcate.runtime.config import EngineArgs
from furcate.runtime.executor.batch import ScheduleBatch
from furcate.runtime.executor.compiled_decode import DecodePlan
from furcate.runtime.executor.decode_runner import DecodeRunner, claimant
from furcate.runtime.executor.model_runner import ModelRunner
from furcate.runtime.model.weights.default_model import find_default_gguf, prepare_user_gguf
from test_greedy_matches_hf import generate_staggered, make_prompts
from tiny_gguf import build_tiny_gguf

BF16_NOISE = 0.15  # logprob differences bfloat16 makes between the two paths here
# Logit differences (of logits up to ~10) between two float32 runs of the tiny GGUF model on the block kernel: it
# codes each group of activations in ~15 bits, so where inductor's elementwise rounding differs from eager's by an
# ulp a code can step, and 3 random layers amplify that; measured up to 2.7e-3, and as much between two packings of
# the same weights whose products agree to 1e-5 (Q4_0 with offsets stored or derived).
ACTIVATION_CODING = 1e-2
COMPILED = {"enable_torch_compile": True, "torch_num_threads": 2, **NO_GRAMMAR}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_greedy_equals_hf(arch, tiny_model_dirs, hf_reference, tokenizer):
    """Batch 1 and mixed-length batches (the two graphs), requests joining and leaving: HF's tokens (float32)."""
    prompts = make_prompts(8, seed=11)
    lengths = [5 + 4 * i for i in range(len(prompts))]
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths]
    with engine_starting(str(tiny_model_dirs[arch]), **EXACT, **COMPILED, max_total_tokens=1500,
                         max_running_requests=4) as started:
        hf = hf_reference(arch)
        expected = [hf.greedy(tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]
        engine = started()
        alone = engine.generate(prompts[0], params[0])
        assert alone["output_ids"] == expected[0]
        assert engine.get_stats()["compiled_forward_calls"] >= lengths[0] - 1  # all but the prefill's token
        together = engine.generate(prompts, params)
        assert [r["output_ids"] for r in together] == expected
        staggered = asyncio.run(generate_staggered(engine, prompts, params))
        assert [r["output_ids"] for r in staggered] == expected
        assert_pool_free(engine)


def test_compiled_bfloat16_decode_stays_with_eager(tmp_path, private_cache):
    """bfloat16 with the GGUF kernels and one dense layer per block: intermediates round where eager rounds them,
    but inductor sums a one-row dense matmul in its own order, so logprobs agree to bfloat16 noise."""
    gguf = str(build_tiny_gguf(tmp_path / "tiny-llama.gguf", find_default_gguf()))
    prepare_user_gguf(gguf)
    common = {"dtype": "bfloat16", "quantization": "gguf", "max_total_tokens": 2000, "torch_num_threads": 2,
              **NO_GRAMMAR}
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    compiled = {**common, "enable_torch_compile": True, "torch_compile_max_bs": 1}  # batch 1: one graph to compile
    with engines_side_by_side((gguf, common), (gguf, compiled)) as engines:
        # (on 200..239 eager's first token is an exact bfloat16 tie, so the two part at once: nothing compared)
        outputs = [e.generate(input_ids=list(range(300, 340)), sampling_params=params, return_logprob=True,
                              top_logprobs_num=2) for e in engines]
        assert engines[1].get_stats()["compiled_forward_calls"] >= 23
        assert engines[0].get_stats()["compiled_forward_calls"] == 0
    ids = [o["output_ids"] for o in outputs]
    same = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), len(ids[0]))
    assert same >= 8
    logprobs = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"][:same]] for o in outputs]
    assert max(abs(a - b) for a, b in zip(*logprobs)) < BF16_NOISE
    if same < len(ids[0]):  # where the two part, eager's top two were within that noise: a near tie
        first, second = outputs[0]["meta_info"]["output_top_logprobs"][same][:2]
        assert first[0] - second[0] < BF16_NOISE


def test_sliding_window_models_decode_eagerly(tiny_model_dirs, hf_reference, tokenizer):
    ids = tokenizer.encode("old machines sang over the river and when the hills")
    with Engine(str(tiny_model_dirs["mistral"]), **EXACT, **COMPILED, max_total_tokens=600) as engine:
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 30, "temperature": 0})
        assert engine.get_stats()["compiled_forward_calls"] == 0
    assert out["output_ids"] == hf_reference("mistral").greedy(ids, 30)


@pytest.mark.parametrize("size", [0, -3, 1.5, float("nan"), "8", True, None])
def test_torch_compile_max_bs_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="torch_compile_max_bs must be an integer >= 1"):
        EngineArgs(torch_compile_max_bs=size)


@pytest.mark.parametrize("flag", ["yes", 1, 0.0, "none"])
def test_enable_torch_compile_must_be_a_bool_or_unset(flag):
    with pytest.raises(ValueError, match=r"enable_torch_compile must be True, False or None \(unset\)"):
        EngineArgs(enable_torch_compile=flag)


@pytest.mark.parametrize(("flags", "value"), [([], None), (["--enable-torch-compile"], True),
                                              (["--no-enable-torch-compile"], False)])
def test_the_torch_compile_flag_has_three_states(flags, value):
    import argparse

    from furcate.runtime.config import add_dataclass_args, from_cli_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(EngineArgs, parser)
    assert from_cli_args(EngineArgs, parser.parse_args(flags)).enable_torch_compile is value


def test_a_failed_compile_leaves_decode_eager(tiny_model_dirs, hf_reference, tokenizer, tmp_path, monkeypatch,
                                              private_cache):
    """No working C++ compiler for inductor (fresh caches, so nothing compiled before is reused): the engine
    starts and serves, eagerly."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ids = tokenizer.encode("the river of stone light")
    with Engine(str(tiny_model_dirs["llama"]), **EXACT, **COMPILED, torch_compile_max_bs=1,
                max_total_tokens=600) as engine:
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
        assert engine.get_stats()["compiled_forward_calls"] == 0
        assert engine.get_stats()["decode_graphs"] == "eager"
    assert out["output_ids"] == hf_reference("llama").greedy(ids, 12)


def test_the_compiled_step_serves_any_pool_size(tiny_model_dirs):
    """The pool's size follows free memory, so it differs from start to start: a graph specialised on it could
    not be saved for the next start. The graph compiled over one pool runs over a pool of another size."""
    from furcate.runtime.cache.memory_pool import TokenToKVPool
    from furcate.runtime.executor.compiled_decode import compile_graph
    from furcate.runtime.model.weights.loader import load_model

    torch.manual_seed(0)
    model = load_model(str(tiny_model_dirs["llama"]), torch.float32, "cpu")
    attn = model.model.layers[0].self_attn
    pools = [TokenToKVPool(size, len(model.model.layers), attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
             for size in (300, 700)]
    graph = compile_graph(model, pools[0], bs=1)
    ids, positions, slots = torch.tensor([7]), torch.tensor([2]), torch.tensor([3])
    logits = []
    with torch.inference_mode():
        for pool in pools:
            for buffer in (*pool.k_buffer, *pool.v_buffer):
                buffer[1:3] = 0.5
            spans = torch.tensor([[0], [1], [2]])  # the one request's token: row 0 of the batch, 2 cached before
            logits.append(graph(model, ids, positions, slots, torch.tensor([[1, 2, 3]]), spans, None,
                                pool.k_buffer, pool.v_buffer))
    torch.testing.assert_close(logits[0], logits[1])
    assert pools[1].k_buffer[0][3].abs().sum() > 0  # the step wrote its key into the pool it was given


def test_a_size_class_of_one_batch_size_compiles_static(tmp_path, private_cache):
    """Where quantization=auto's kernels serve up to 2 rows, the classes are 1, 2 and 3+: the class from 2 holds
    only 2, and its `rows <= 2` pins the batch size, which a dynamic graph refuses. It compiles static, and both
    graphs above batch 1 give the eager step's logits."""
    from furcate.runtime.cache.memory_pool import TokenToKVPool
    from furcate.runtime.executor.compiled_decode import compile_graphs, decode_step, size_classes
    from furcate.runtime.executor.serving_model import load_serving_model

    gguf = str(build_tiny_gguf(tmp_path / "tiny-llama.gguf", find_default_gguf()))
    model_dir = prepare_user_gguf(gguf)
    model, quantized = load_serving_model(model_dir, torch.float32, "auto", graphs=True, quantized_rows=2)
    assert quantized.max_rows == 2 and size_classes(4, quantized.max_rows) == [1, 2, 3]
    attn = model.model.layers[0].self_attn
    pool = TokenToKVPool(64, len(model.model.layers), attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
    graphs = compile_graphs(model, pool, [2, 3])
    with torch.inference_mode():
        for bs, graph in graphs.items():
            ids, positions, slots = torch.arange(5, 5 + bs), torch.full((bs,), 2), torch.arange(10, 10 + bs)
            table = torch.stack([torch.tensor([1, 2, 10 + b]) for b in range(bs)])
            spans = torch.stack([torch.arange(bs), torch.ones(bs, dtype=torch.long), torch.full((bs,), 2)])
            for buffer in (*pool.k_buffer, *pool.v_buffer):
                buffer[1:3] = 0.5
            inputs = (model, ids, positions, slots, table, spans, None, pool.k_buffer, pool.v_buffer)
            eager = decode_step(*inputs)  # writes the same K/V the graph then writes again
            got = graph(*inputs)
            assert got.shape[0] == bs
            torch.testing.assert_close(got, eager, rtol=0, atol=ACTIVATION_CODING)



def laid_out(runner: ModelRunner, requests: list[tuple[int, list[int], int]]) -> ScheduleBatch:
    """A batch over the runner's pools: per request, its request row, its token ids and how many of them have
    K/V already; the logits of each request's last token."""
    cached = torch.tensor([done for _, _, done in requests])
    new = torch.tensor([len(ids) - done for _, ids, done in requests])
    slots = [runner.kv_pool.alloc(int(n)) for n in new]
    for (row, ids, done), taken in zip(requests, slots):
        runner.req_pool.req_to_token[row, done : len(ids)] = taken
    ends = new.cumsum(0).tolist()
    forward = ForwardBatch(
        input_ids=torch.tensor([i for _, ids, done in requests for i in ids[done:]]),
        positions=torch.cat([torch.arange(done, len(ids)) for _, ids, done in requests]),
        out_cache_loc=torch.cat(slots), req_pool_indices=torch.tensor([row for row, _, _ in requests]),
        prefix_lens=cached, extend_lens=new, seq_lens=cached + new, req_to_token_pool=runner.req_pool,
        token_to_kv_pool=runner.kv_pool)
    return ScheduleBatch([], forward, [range(end - 1, end) for end in ends])


def test_the_first_runner_that_takes_a_batch_runs_it(tiny_model_dirs):
    """Compiled decode with a graph for batch 1 only: a decode step of one request runs it; a prefill, a
    one-token prompt and a step of two requests run eagerly. The forward thread finds the runner that planned each
    batch: one planned eagerly (as before graphs the background build delivered were adopted) stays eager, and
    gives the compiled step's logits."""
    args = EngineArgs(device="cpu", **EXACT, **COMPILED, torch_compile_max_bs=1, max_total_tokens=600)
    runner = ModelRunner(args, str(tiny_model_dirs["llama"]))
    assert runner.runners == [runner.compiled, runner.eager] and runner.decode_graphs() == "compiled"
    prompts = {1: [5, 9, 14, 3], 2: [7, 2, 8, 8, 11, 4]}

    def run(requests: list[tuple[int, list[int], int]]) -> tuple[DecodeRunner, torch.Tensor, ForwardBatch]:
        batch = laid_out(runner, requests)
        runner.prepare(batch)
        taker = claimant(runner.runners, batch.forward)
        return taker, runner.forward(batch), batch.forward

    assert run([(row, ids, 0) for row, ids in prompts.items()])[0] is runner.eager
    assert run([(3, [21], 0)])[0] is runner.eager  # a context of one: no graph is traced for it
    assert run([(row, ids + [30], len(ids)) for row, ids in prompts.items()])[0] is runner.eager
    step = (1, prompts[1] + [30, 31], 5)
    taker, logits, forward = run([step])
    assert taker is runner.compiled and isinstance(forward.attn_metadata, DecodePlan)
    assert runner.compiled.calls == 1 and runner.forward_calls == 4
    planned_eagerly = laid_out(runner, [step]).forward
    runner.eager.prepare(planned_eagerly)
    assert claimant(runner.runners, planned_eagerly) is runner.eager
    torch.testing.assert_close(runner.eager.run(planned_eagerly, torch.tensor([0])), logits, rtol=1e-4, atol=1e-4)
