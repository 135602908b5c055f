"""CPU linears through oneDNN with prepacked weights (runtime/model/packed_linear.py): in bfloat16 the same bits as
F.linear on this machine, in float32 its values to float32 noise from the rows the measurement chose, greedy output
equal to HF's with every float32 layer packed (eager and compiled), and an engine that repacks whenever its weights
are written (updates, resumed memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from conftest import EXACT, NO_GRAMMAR, engine_starting, engines_side_by_side
from furcate.runtime.model import kernel_choice
from furcate.runtime.model.packed_linear import (
    PackedLinear,
    native_kernel,
    pack_linears,
    packed_linear_op,
    packs,
    repack_linears,
)
from rl_trainer import round_weights
from test_greedy_matches_hf import make_prompts

needs_bf16 = pytest.mark.skipif(not packs(torch.bfloat16, "cpu"),
                                reason="this CPU's oneDNN has no native bfloat16, so nothing is packed")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
PROMPT = list(range(300, 340))
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("shape", [(64, 32), (960, 576), (576, 1536)])
def test_a_packed_linear_gives_f_linears_bits(rows, shape, monkeypatch):
    monkeypatch.setenv("FURCATE_DENSE_GEMV", "0")  # the packed copy at one row too (the GEMV sums in another order)
    torch.manual_seed(rows)
    layer = torch.nn.Linear(shape[1], shape[0], bias=rows % 2 == 1, dtype=torch.bfloat16)
    model = torch.nn.Sequential(layer)
    assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear) and model[0] is layer
    x = torch.randn(2, rows, shape[1], dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2)  # a write the layer was not told of is not seen; a repack sees it
        assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.repack()
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16
def test_an_updated_engine_serves_the_new_weights_as_an_engine_loaded_with_them(tiny_model_dirs, tmp_path):
    """Updated weights reach the packed copies (a stale copy would serve the old projections), and released then
    resumed weights serve as before."""
    source = tiny_model_dirs["llama"]
    new = round_weights(source, 3)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.load_state_dict(new)
    model.save_pretrained(tmp_path)
    args = {"dtype": "bfloat16", "max_total_tokens": 2000, "torch_num_threads": 1, **NO_GRAMMAR}
    with engines_side_by_side((str(source), args), (str(tmp_path), {**args, "tokenizer_path": str(source)})) as (
            updated, loaded):
        def greedy(engine):
            out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
            return out["output_ids"], [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]

        before = greedy(updated)
        assert updated.update_weights_from_tensor(list(new.items()))[0]
        assert greedy(updated) == greedy(loaded) != before
        assert updated.release_memory_occupation()[0]
        assert updated.resume_memory_occupation()[0]
        assert greedy(updated) == greedy(loaded)


def float32_layer(shape: tuple[int, int], from_rows: int | None) -> PackedLinear:
    torch.manual_seed(shape[0])
    layer = torch.nn.Linear(shape[1], shape[0])
    layer.__class__ = PackedLinear
    layer.repack()
    layer.from_rows = from_rows
    return layer


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 8, 64])
def test_a_float32_packed_linear_serves_its_copy_from_the_chosen_rows(rows):
    """From from_rows on: oneDNN's values, float32 noise from F.linear's; below: F.linear's bits."""
    layer = float32_layer((960, 576), from_rows=8)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        out, plain = layer(x), F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        if rows < 8:
            assert torch.equal(out, plain)
        layer.from_rows = None  # never packs
        assert torch.equal(layer(x), plain)


@needs_onednn
def test_the_compiled_op_finds_the_layers_packed_copy_and_never_a_stale_one():
    layer = float32_layer((576, 1536), from_rows=1)
    x = torch.randn(4, 1536)
    with torch.inference_mode():
        assert torch.equal(packed_linear_op(x, layer.weight, layer.bias), layer(x))
        other = torch.randn(576, 1536)  # a weight no layer packed: F.linear
        assert torch.equal(packed_linear_op(x, other, None), F.linear(x, other))
        layer.weight = torch.nn.Parameter(torch.randn(576, 1536))  # replaced, not repacked: never the old copy
        torch.testing.assert_close(packed_linear_op(x, layer.weight, layer.bias),
                                   F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_float32_packing_is_measured_once_per_shape_and_kept(private_cache, idle_machine, tmp_path, monkeypatch):
    layers = [float32_layer(shape, 1) for shape in ((96, 64), (64, 96), (96, 64))]
    measured = []
    monkeypatch.setattr(kernel_choice, "packed_crossover",
                        lambda group: measured.append(len(group)) or (8 if group[0].out_features == 96 else None))
    assert kernel_choice.packed_from_rows(layers) == [8, None, 8]
    assert sorted(measured) == [1, 2]
    assert kernel_choice.packed_from_rows(layers) == [8, None, 8] and len(measured) == 2  # kept on disk
    for path in (tmp_path / "kernel_choice").iterdir():
        path.write_text('{"value": {"[96, 64]": 3}}')  # damaged: not a rung, a shape missing
    assert kernel_choice.packed_from_rows(layers) == [8, None, 8] and len(measured) == 4


@needs_onednn
@pytest.mark.parametrize("packed_wins_at, chosen", [
    ((1, 8, 64), 1), ((8, 64), 8), ((1, 64), 64),  # a loss at 8 rows: only 64 and up
    ((), None), ((1, 8), None),  # a loss at the top rung: never
])
def test_the_measurement_packs_from_the_rows_where_it_wins_at_every_larger_count(packed_wins_at, chosen,
                                                                                   monkeypatch):
    """packed_crossover times both paths at each rung (real layers, their inputs of that many rows) and picks the
    smallest rung from which the packed copy wins at every larger one."""
    timed_rows = []

    def best_seconds(paths, x):
        rows = x.shape[0]
        timed_rows.append(rows)
        assert len(paths[0]) == len(paths[1]) == 3
        torch.testing.assert_close(paths[0][0](x), paths[1][0](x), rtol=1e-5, atol=1e-5)  # the same linear
        return (1.0, 2.0) if rows in packed_wins_at else (2.0, 1.0)

    monkeypatch.setattr(kernel_choice, "best_seconds", best_seconds)
    layers = [float32_layer((256, 128), 1) for _ in range(3)]
    assert kernel_choice.packed_crossover(layers) == chosen
    assert timed_rows[0] == 64 and timed_rows == sorted(timed_rows, reverse=True)


@needs_onednn
def test_switch_off_packs_nothing(monkeypatch):
    monkeypatch.setenv("FURCATE_PACKED_LINEAR", "0")
    assert not packs(torch.float32, "cpu") and not packs(torch.bfloat16, "cpu")
    monkeypatch.setenv("FURCATE_PACKED_LINEAR", "1")
    assert packs(torch.float32, "cpu") and not packs(torch.float32, "cuda")


@needs_onednn
def test_every_float32_layer_packed_keeps_greedy_output_equal_to_hf(tiny_model_dirs, hf_reference, tokenizer,
                                                                     private_cache, monkeypatch):
    """FURCATE_PACKED_LINEAR=1 packs every float32 layer from one row, FURCATE_DENSE_GEMV=1 runs one row through
    the dense GEMV where it is built: prefill, eager decode and the compiled batch-1 graph (through
    furcate::packed_linear) still give HF's greedy tokens."""
    monkeypatch.setenv("FURCATE_PACKED_LINEAR", "1")
    monkeypatch.setenv("FURCATE_DENSE_GEMV", "1")
    prompts = make_prompts(3, seed=5)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with engine_starting(str(tiny_model_dirs["llama"]), **EXACT, enable_torch_compile=True, torch_compile_max_bs=1,
                         torch_num_threads=2, max_total_tokens=1500, **NO_GRAMMAR) as started:
        expected = [hf_reference("llama").greedy(tokenizer.encode(p), 12) for p in prompts]
        engine = started()
        assert engine.generate(prompts[0], params)["output_ids"] == expected[0]
        assert engine.get_stats()["compiled_forward_calls"] >= 11
        assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected  # eager batches of 3


@needs_onednn
def test_copies_that_would_crowd_the_memory_are_not_made(monkeypatch):
    from furcate.runtime.model import packed_linear

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))  # 24 KiB of weights
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: 40 * 1024)
    assert pack_linears(model) == 0 and all(type(layer) is torch.nn.Linear for layer in model)
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: 1 << 30)
    monkeypatch.setenv("FURCATE_PACKED_LINEAR", "1")
    assert pack_linears(model) == 2 and all(isinstance(layer, PackedLinear) for layer in model)


def gemv_built(dtype: torch.dtype) -> bool:
    return native_kernel() and torch.ops.furcate.dense_gemv_built(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (960, 576), (576, 1536), (49152, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_dense_gemv_is_f_linear_at_one_row(dtype, shape, bias):
    """float32 to float32 noise; bfloat16 within one rounding of F.linear (both sum exact products in float32, in
    another order, and round once)."""
    if not gemv_built(dtype):
        pytest.skip(f"no dense GEMV for {dtype} on this CPU")
    generator = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(shape, generator=generator).to(dtype)
    b = torch.randn(shape[0], generator=generator).to(dtype) if bias else None
    x = torch.randn(1, 1, shape[1], generator=generator).to(dtype)
    got, expected = torch.ops.furcate.dense_gemv(x, weight, b), F.linear(x, weight, b)
    assert got.shape == expected.shape == (1, 1, shape[0]) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert ((got.double() - exact).abs() <= 2 * (expected.double() - exact).abs() + 1e-2 * exact.abs()).all()
        assert (got != expected).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_gemv_refuses_what_it_does_not_take(dtype):
    if not gemv_built(dtype):
        pytest.skip(f"no dense GEMV for {dtype} on this CPU")
    weight = torch.randn(32, 128).to(dtype)
    for x, w, b in ((torch.randn(2, 128).to(dtype), weight, None),  # two rows
                    (torch.randn(1, 96).to(dtype), torch.randn(32, 96).to(dtype), None),  # K not 64s
                    (torch.randn(1, 128).double(), weight, None),  # another dtype
                    (torch.randn(1, 256).to(dtype)[:, ::2], weight, None),  # a strided row
                    (torch.randn(1, 128).to(dtype), torch.randn(128, 32).to(dtype).t(), None),  # a strided weight
                    (torch.randn(1, 128).to(dtype), weight, torch.randn(31).to(dtype)),  # a bias of another size
                    (torch.randn(1, 128).to(dtype), weight.view(32, 2, 64), None)):  # not a matrix
        with pytest.raises(ValueError, match="dense GEMV takes"):
            torch.ops.furcate.dense_gemv(x, w, b)


def test_the_dense_gemv_serves_one_row_where_it_measured_faster(private_cache, idle_machine, monkeypatch):
    """gemv_wins is measured once per shape and kept; layers whose shape it won run one row through it, the rest
    stay on the packed copy, and both give F.linear's values."""
    if not gemv_built(torch.float32):
        pytest.skip("no float32 dense GEMV on this CPU")
    monkeypatch.setenv("FURCATE_PACKED_LINEAR", "1")
    measured = []
    monkeypatch.setattr(kernel_choice, "gemv_wins",
                        lambda group: measured.append(len(group)) or group[0].out_features == 128)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 128),
                                torch.nn.Linear(64, 96))
    model[3].weight = torch.nn.Parameter(torch.randn(96, 128)[:, ::2])  # not contiguous: never measured
    assert pack_linears(model) == 4
    assert [layer.gemv for layer in model] == [True, False, True, False] and sorted(measured) == [1, 2]
    pack_linears(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)))
    assert sorted(measured) == [1, 2]  # kept on disk
    with torch.inference_mode():
        for layer in model:
            x = torch.randn(1, layer.in_features)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(packed_linear_op(x, layer.weight, layer.bias), layer(x))
    monkeypatch.setenv("FURCATE_DENSE_GEMV", "0")
    off = torch.nn.Sequential(torch.nn.Linear(64, 128))
    assert pack_linears(off) == 1 and not off[0].gemv and len(measured) == 2


@pytest.mark.parametrize("gemv_s, packed_s, wins", [(1.0, 2.0, True), (0.96, 1.0, False), (2.0, 1.0, False)])
def test_gemv_wins_times_both_paths_on_the_layers_at_one_row(gemv_s, packed_s, wins, monkeypatch):
    if not gemv_built(torch.float32):
        pytest.skip("no float32 dense GEMV on this CPU")

    def best_seconds(paths, x):
        assert x.shape == (1, 128) and len(paths[0]) == len(paths[1]) == 2
        torch.testing.assert_close(paths[0][0](x), paths[1][0](x))  # the same linear, two kernels
        return gemv_s, packed_s

    monkeypatch.setattr(kernel_choice, "best_seconds", best_seconds)
    assert kernel_choice.gemv_wins([float32_layer((64, 128), 1) for _ in range(2)]) is wins


def test_a_layer_that_packs_from_no_row_still_takes_the_gemv_at_one_row(private_cache, idle_machine, monkeypatch):
    """Where F.linear beat the packed copy at every rung (MKL on an AVX2-only CPU), the layer keeps no copy, yet one
    row runs the dense GEMV where it beat F.linear: eagerly, through the compiled op, and after its weight is
    replaced (repack_linears tells the op the new weight)."""
    if not gemv_built(torch.float32):
        pytest.skip("no float32 dense GEMV on this CPU")
    monkeypatch.setattr(kernel_choice, "packed_crossover", lambda group: None)
    against = []
    monkeypatch.setattr(kernel_choice, "gemv_wins",
                        lambda group: against.append(kernel_choice.one_row_call(group[0]).__name__) or True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    assert pack_linears(model) == 0 and against == ["plain_call", "plain_call"]  # per shape, against F.linear
    assert all(layer.packed is None and layer.from_rows is None and layer.gemv for layer in model)
    gemv = torch.ops.furcate.dense_gemv
    with torch.inference_mode():
        for layer in model:  # one row: the GEMV's own bits (it sums in its order); more: F.linear's
            x, rows = torch.randn(1, layer.in_features), torch.randn(5, layer.in_features)
            assert torch.equal(packed_linear_op(x, layer.weight, layer.bias), gemv(x, layer.weight, layer.bias))
            assert torch.equal(layer(x), gemv(x, layer.weight, layer.bias))
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
            assert torch.equal(packed_linear_op(rows, layer.weight, layer.bias), F.linear(rows, layer.weight,
                                                                                            layer.bias))
        model[0].weight = torch.nn.Parameter(torch.randn(128, 64))
        repack_linears(model)
        x = torch.randn(1, 64)
        assert torch.equal(packed_linear_op(x, model[0].weight, model[0].bias),
                           gemv(x, model[0].weight, model[0].bias))
    assert model[0].packed is None and model[0].gemv
