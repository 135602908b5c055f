"""The flashinfer attention backend against torch_native: decode, extend with and without a cached prefix, mixed
batches, GQA group sizes, sliding windows, shared-prefix cascades and CUDA-graph decode, in float16 and bfloat16.

Where there is no GPU the backend runs over tests/flashinfer_fake.py, which computes FlashInfer's documented
semantics in torch: that checks the plans, the window and causal conventions, the token bookkeeping and the
double-buffered wrappers, and every call made to FlashInfer is bound to the installed package's signatures when
flashinfer is importable. With CUDA and flashinfer the same cases run on the real kernels, a decode batch is
captured in a CUDA graph and replayed, and the engine's output is checked against HF transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

from flashinfer_fake import Recorder, make_module
from furcate.runtime import registry
from furcate.runtime.attention import select
from furcate.runtime.attention.base import ForwardBatch, ModelAttention
from furcate.runtime.attention.cascade import MIN_SHARED_TOKENS
from furcate.runtime.attention.flashinfer_backend import CascadeRun, FlashInferAttention, check_supported, window_left
from furcate.runtime.attention.torch_native import TorchNativeAttention
from furcate.runtime.cache.memory_pool import ReqToTokenPool, TokenToKVPool
from furcate.runtime.executor.cuda_graph import batch_size_ladder, pad_decode_batch, padded_batch_size

HEADS, HEAD_DIM, CONTEXT = 8, 64, 256
SCALING = HEAD_DIM**-0.5
SHARED = MIN_SHARED_TOKENS + 6  # slots a prefix group shares: enough for cascade attention
WINDOW = 16  # shorter than most requests below, so the window cuts in
TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}
FLASHINFER_INSTALLED = importlib.util.find_spec("flashinfer") is not None
ON_GPU = torch.cuda.is_available() and FLASHINFER_INSTALLED
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="the real FlashInfer kernels need CUDA and the flashinfer package")

# (prefix_len, extend_len) per request, and each request's prefix group (requests of a group start with the
# same SHARED cached slots; None: no group).
SCENARIOS = {
    "decode": ([(30, 1), (5, 1), (61, 1), (17, 1)], None),
    "extend": ([(0, 17), (0, 5), (0, 33)], None),
    "extend_cached": ([(20, 7), (3, 12), (40, 30)], None),
    "mixed": ([(25, 1), (0, 9), (14, 6), (50, 1)], None),
    "cascade_decode": ([(5, 1), (9, 1), (12, 1), (30, 1), (7, 1), (2, 1)], [0, 0, None, 1, 1, 0]),
    "cascade_extend": ([(5, 3), (9, 1), (12, 6), (30, 2)], [0, 0, None, 0]),
    "cascade_all_grouped": ([(4, 2), (8, 1), (0, 5)], [0, 0, 0]),
}
# Attention window per layer of a two-layer model.
LAYER_WINDOWS = {"full": (None, None), "sliding": (None, WINDOW), "all_sliding": (WINDOW, WINDOW)}
KV_HEADS = (8, 4, 2, 1)  # GQA groups 1, 2, 4, 8: CUDA-core and tensor-core decode
# Every scenario and window in bfloat16, float16 on full attention (on a GPU each dtype and window is a kernel
# FlashInfer compiles).
CASES = [pytest.param(name, windows, torch.bfloat16, id=f"{name}-{windows}-bf16")
         for name in SCENARIOS for windows in LAYER_WINDOWS]
CASES += [pytest.param(name, "full", torch.float16, id=f"{name}-full-fp16") for name in SCENARIOS]


def make_batch(shapes: list[tuple[int, int]], groups: list[int | None] | None, kv_heads: int, dtype: torch.dtype,
               device: str, seed: int = 0, kv_pool: TokenToKVPool | None = None) -> ForwardBatch:
    """A batch over random pools on `device` (new ones, or new slots of `kv_pool`); its lengths and slots on the
    host, as the scheduler builds them."""
    req_pool = ReqToTokenPool(len(shapes) + 1, CONTEXT)
    if kv_pool is None:
        generator = torch.Generator().manual_seed(seed)
        kv_pool = TokenToKVPool(2048, 2, kv_heads, HEAD_DIM, dtype, device)
        for buffer in kv_pool.k_buffer + kv_pool.v_buffer:
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
    heads: dict[int, torch.Tensor] = {}
    rows, out_cache, prefix_lens = [], [], []
    for (prefix_len, extend_len), group in zip(shapes, groups or [None] * len(shapes)):
        head = heads.setdefault(group, kv_pool.alloc(SHARED)) if group is not None else torch.zeros(0, dtype=torch.long)
        slots = torch.cat([head, kv_pool.alloc(prefix_len + extend_len)])
        row = req_pool.alloc()
        req_pool.req_to_token[row, : len(slots)] = slots.to(device)
        rows.append(row)
        prefix_lens.append(len(head) + prefix_len)
        out_cache.append(slots[prefix_lens[-1] :])
    prefix = torch.tensor(prefix_lens)
    extend = torch.tensor([e for _, e in shapes])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend.tolist())])
    return ForwardBatch(input_ids=torch.zeros(len(positions), dtype=torch.long), positions=positions,
                        out_cache_loc=torch.cat(out_cache), req_pool_indices=torch.tensor(rows), prefix_lens=prefix,
                        extend_lens=extend, seq_lens=prefix + extend, req_to_token_pool=req_pool,
                        token_to_kv_pool=kv_pool)


def on_cpu_in_float32(batch: ForwardBatch) -> ForwardBatch:
    """The batch over float32 CPU copies of its pools: torch_native's reference input."""
    req_pool, kv_pool = copy.copy(batch.req_to_token_pool), copy.copy(batch.token_to_kv_pool)
    req_pool.req_to_token = req_pool.req_to_token.cpu()
    kv_pool.k_buffer = [b.float().cpu() for b in kv_pool.k_buffer]
    kv_pool.v_buffer = [b.float().cpu() for b in kv_pool.v_buffer]
    return dataclasses.replace(batch, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_metadata=None)


def model(dtype: torch.dtype, layer_windows: tuple[int | None, ...]) -> ModelAttention:
    return ModelAttention(num_heads=HEADS, head_dim=HEAD_DIM, scaling=SCALING, dtype=dtype,
                          windows=frozenset(layer_windows))


class Reference:
    """torch_native over a float32 CPU copy of the batch, planned before the batch under test changes."""

    def __init__(self, batch: ForwardBatch) -> None:
        self.batch = on_cpu_in_float32(batch)
        self.backend = TorchNativeAttention()
        self.backend.init_forward_metadata(self.batch)

    def forward(self, q, k, v, layer: int, window: int | None) -> torch.Tensor:
        self.backend.begin_forward(self.batch)
        return self.backend.forward(q.float().cpu(), k.float().cpu(), v.float().cpu(), layer, SCALING, window)


def random_qkv(tokens: int, kv_heads: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, heads, HEAD_DIM, generator=generator).to(dtype).to(device)
                 for heads in (HEADS, kv_heads, kv_heads))


def run_layers(backend, batch: ForwardBatch, reference: Reference, layer_windows, kv_heads: int, dtype, device,
               rows: int | None = None, seed: int = 0) -> None:
    """Each layer's output equals torch_native's (on the first `rows` tokens: the rest are graph padding)."""
    backend.begin_forward(batch)
    tokens = int(batch.extend_lens.sum())
    for layer, window in enumerate(layer_windows):
        q, k, v = random_qkv(tokens, kv_heads, dtype, device, seed + layer)
        got = backend.forward(q, k, v, layer, SCALING, window)
        assert got.shape == (tokens, HEADS * HEAD_DIM) and got.dtype == dtype and got.device == q.device
        real = slice(rows)
        expected = reference.forward(q[real], k[real], v[real], layer, window)
        torch.testing.assert_close(got[real].float().cpu(), expected, **TOLERANCE[dtype])


def check_scenario(name: str, windows: str, kv_heads: int, dtype: torch.dtype, device: str) -> FlashInferAttention:
    shapes, groups = SCENARIOS[name]
    layer_windows = LAYER_WINDOWS[windows]
    batch = make_batch(shapes, groups, kv_heads, dtype, device)
    backend = FlashInferAttention(model(dtype, layer_windows))
    reference = Reference(batch)
    backend.init_forward_metadata(batch)
    full = batch.attn_metadata.attend.get(None)
    assert isinstance(full, CascadeRun) == (groups is not None and None in layer_windows)
    run_layers(backend, batch, reference, layer_windows, kv_heads, dtype, device)
    return backend


@pytest.fixture
def fake_flashinfer(monkeypatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "flashinfer", make_module(recorder))
    return recorder


# -- on any machine: the fake FlashInfer ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("name, windows, dtype", CASES)
def test_backend_over_the_fake_matches_torch_native(fake_flashinfer, name, windows, kv_heads, dtype):
    check_scenario(name, windows, kv_heads, dtype, "cpu")


def test_decode_batches_plan_the_decode_wrapper_on_tensor_cores_from_gqa_group_4(fake_flashinfer):
    for kv_heads in KV_HEADS:
        backend = check_scenario("decode", "full", kv_heads, torch.bfloat16, "cpu")
        wrapper = backend.wrapper_sets[0]["decode", None]
        assert wrapper.use_tensor_cores == (HEADS // kv_heads >= 4)
    assert not any(name.startswith("BatchPrefill") for name, _, _ in fake_flashinfer.calls)


def test_the_window_is_flashinfers_window_left_plus_one():
    assert window_left(None) == -1
    assert window_left(WINDOW) == WINDOW - 1


def test_consecutive_batches_plan_into_alternating_wrappers(fake_flashinfer):
    """The overlap loop plans batch N+1 while N's layers run: N's plan must survive it."""
    dtype, device = torch.bfloat16, "cpu"
    backend = FlashInferAttention(model(dtype, (None, WINDOW)))
    batches = [make_batch(*SCENARIOS[name], 2, dtype, device, seed=i)
               for i, name in enumerate(["extend_cached", "mixed", "extend"])]  # all three plan prefill wrappers
    references = [Reference(b) for b in batches]
    backend.init_forward_metadata(batches[0])
    backend.init_forward_metadata(batches[1])
    run_layers(backend, batches[0], references[0], (None, WINDOW), 2, dtype, device)
    backend.init_forward_metadata(batches[2])  # batch 0 has completed: its wrappers are free again
    run_layers(backend, batches[1], references[1], (None, WINDOW), 2, dtype, device)
    run_layers(backend, batches[2], references[2], (None, WINDOW), 2, dtype, device)
    assert backend.wrapper_sets[0]["prefill", None] is batches[2].attn_metadata.attend[None].__self__


@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("windows", ["full", "sliding"])
def test_graph_decode_plans_into_fixed_buffers_per_batch_size(fake_flashinfer, windows, kv_heads):
    dtype, device, layer_windows = torch.bfloat16, "cpu", LAYER_WINDOWS[windows]
    backend = FlashInferAttention(model(dtype, layer_windows))
    backend.init_cuda_graph_state(max_bs=8, max_context_len=CONTEXT, device=device)
    sizes = batch_size_ladder(8)
    seen = {}
    for seed, real in enumerate([3, 1, 4, 3, 5]):
        shapes = [(10 + 13 * i + seed, 1) for i in range(real)]
        batch = make_batch(shapes, None, kv_heads, dtype, device, seed=seed)
        reference = Reference(batch)
        padded = pad_decode_batch(batch, padded_batch_size(sizes, real))
        backend.init_forward_metadata_graph(padded)
        run_layers(backend, padded, reference, layer_windows, kv_heads, dtype, device, rows=real, seed=seed)
        size = padded.batch_size
        wrappers = backend.graph.wrappers[size]
        assert seen.setdefault(size, wrappers) is wrappers  # a size's wrappers (and buffers) are made once
        assert set(wrappers) == set(layer_windows)
        for wrapper in wrappers.values():
            assert wrapper.use_cuda_graph and wrapper.buffers[1] is backend.graph.kv_indices
    with pytest.raises(ValueError, match="exceeds"):
        backend.init_forward_metadata_graph(make_batch([(5, 1)] * 9, None, kv_heads, dtype, device))


def test_graph_planning_needs_the_graph_state(fake_flashinfer):
    backend = FlashInferAttention(model(torch.bfloat16, (None,)))
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_graph(make_batch([(5, 1)], None, 2, torch.bfloat16, "cpu"))


@pytest.mark.parametrize("dtype, head_dim, reason", [
    (torch.float32, 64, "runs float16 and bfloat16"),
    (torch.bfloat16, 16, "runs head_dim"),
])
def test_models_the_kernels_cannot_run_are_refused_at_start(dtype, head_dim, reason):
    with pytest.raises(ValueError, match=reason):
        check_supported(ModelAttention(num_heads=4, head_dim=head_dim, scaling=0.1, dtype=dtype))


@pytest.fixture
def reloaded_select(monkeypatch):
    """select.py re-imported with flashinfer installed or not, over a copy of the registry."""
    real_find_spec = importlib.util.find_spec

    def reload(installed: bool):
        monkeypatch.setitem(registry._ENTRIES, select.KIND, {})
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *rest: (object() if installed else None) if name == "flashinfer"
                            else real_find_spec(name, *rest))
        return importlib.reload(select)

    yield reload
    monkeypatch.undo()
    importlib.reload(select)


@pytest.mark.parametrize("installed", [False, True])
def test_flashinfer_is_registered_only_where_its_package_is_installed(reloaded_select, installed):
    reloaded = reloaded_select(installed)
    triton = ("triton",) if importlib.util.find_spec("triton") else ()
    expected = ("auto", "torch_native", *triton) + (("flashinfer",) if installed else ())
    assert registry.names(select.KIND) == expected
    if installed:
        assert registry._ENTRIES[select.KIND]["flashinfer"].target == \
            "furcate.runtime.attention.flashinfer_backend:FlashInferAttention"
    assert reloaded.resolve_attention_backend("auto", "cpu") == "torch_native"


def test_make_attention_backend_builds_flashinfer_with_the_models_attention(reloaded_select, fake_flashinfer,
                                                                            monkeypatch):
    reloaded = reloaded_select(True)
    monkeypatch.setattr(reloaded, "cuda_available", lambda: True)
    shape = model(torch.bfloat16, (None, WINDOW))
    backend = reloaded.make_attention_backend("auto", "cuda", shape)
    assert isinstance(backend, FlashInferAttention) and backend.model == shape
    with pytest.raises(ValueError, match="needs the model's attention shape"):
        reloaded.make_attention_backend("flashinfer", "cuda")
    with pytest.raises(ValueError, match="runs only on CUDA"):
        reloaded.make_attention_backend("flashinfer", "cpu", shape)
    assert isinstance(reloaded.make_attention_backend("torch_native", "cuda", shape), TorchNativeAttention)


def test_the_runner_describes_each_layers_window():
    from furcate.runtime.executor.model_runner import model_attention
    from furcate.runtime.model.decoder import DecoderForCausalLM
    from furcate.runtime.model.families import FAMILIES
    from tiny_models import CONFIGS

    for arch, family, windows in [("llama", "LlamaForCausalLM", {None}), ("mistral", "MistralForCausalLM", {24})]:
        decoder = DecoderForCausalLM(CONFIGS[arch](), FAMILIES[family])
        shape = model_attention(decoder, torch.bfloat16)
        assert shape == ModelAttention(num_heads=4, head_dim=16, scaling=16**-0.5, dtype=torch.bfloat16,
                                       windows=frozenset(windows), num_kv_heads=2)


# -- where flashinfer is installed (any machine): our calls against the real package ---------------------------------


def _record_every_kind_of_call(recorder: Recorder) -> None:
    for name, windows in [("decode", "sliding"), ("mixed", "sliding"), ("cascade_decode", "full"),
                          ("cascade_extend", "full")]:
        check_scenario(name, windows, 2, torch.bfloat16, "cpu")
    check_scenario("decode", "full", 1, torch.float16, "cpu")  # tensor-core decode
    backend = FlashInferAttention(model(torch.bfloat16, (None, WINDOW)))
    backend.init_cuda_graph_state(max_bs=4, max_context_len=CONTEXT, device="cpu")
    batch = make_batch([(7, 1), (20, 1), (3, 1)], None, 2, torch.bfloat16, "cpu")
    backend.init_forward_metadata_graph(pad_decode_batch(batch, 4))


@pytest.mark.skipif(not FLASHINFER_INSTALLED, reason="binds our calls to the installed flashinfer's signatures")
def test_every_call_binds_to_the_installed_flashinfer_signatures(monkeypatch):
    real = importlib.import_module("flashinfer")
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "flashinfer", make_module(recorder))
    _record_every_kind_of_call(recorder)
    names = {name for name, _, _ in recorder.calls}
    assert {"BatchPrefillWithPagedKVCacheWrapper.plan", "BatchDecodeWithPagedKVCacheWrapper.plan",
            "merge_state_in_place"} <= names
    for name, args, kwargs in recorder.calls:
        target = real
        for part in name.split("."):
            target = getattr(target, part)
        bound_self = (None,) if "." in name else ()
        inspect.signature(target).bind(*bound_self, *args, **kwargs)  # TypeError on a name or arity 0.6.0 lacks


@pytest.mark.skipif(not FLASHINFER_INSTALLED, reason="reads the installed flashinfer's kernel sources")
def test_the_installed_flashinfer_keeps_the_conventions_the_backend_relies_on():
    import flashinfer
    from flashinfer.jit.utils import dtype_map

    root = Path(flashinfer.__file__).parent / "data" / "include" / "flashinfer"
    variants = (root / "attention" / "variants.cuh").read_text()
    assert "kv_idx + qo_len + window_left >= kv_len + qo_idx" in variants  # window_left = sliding_window - 1
    prefill = (root / "attention" / "prefill.cuh").read_text()
    assert "kv_idx + qo_len > kv_len + q_idx" in prefill  # causal masks align the last query with the last key
    assert torch.float32 not in dtype_map and {torch.float16, torch.bfloat16} <= set(dtype_map)


# -- with CUDA and flashinfer: the real kernels -----------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("name, windows, dtype", CASES)
def test_flashinfer_on_the_gpu_matches_torch_native(name, windows, kv_heads, dtype):
    check_scenario(name, windows, kv_heads, dtype, "cuda")


@needs_gpu
@pytest.mark.parametrize("windows", ["full", "sliding"])
def test_a_captured_decode_graph_replays_new_batches_of_its_size(windows):
    dtype, device, kv_heads, size = torch.bfloat16, "cuda", 2, 4
    layer_windows = LAYER_WINDOWS[windows]
    backend = FlashInferAttention(model(dtype, layer_windows))
    backend.init_cuda_graph_state(max_bs=size, max_context_len=CONTEXT, device=device)
    static_loc = torch.zeros(size, dtype=torch.long, device=device)
    static_qkv = [random_qkv(size, kv_heads, dtype, device, seed=layer) for layer in range(len(layer_windows))]
    kv_pool = make_batch([(1, 1)], None, kv_heads, dtype, device).token_to_kv_pool  # the graph reads its buffers

    def prepare(seed: int, real: int) -> Reference:
        """Plan a new batch of `real` requests padded to the captured size, as a replay does."""
        batch = make_batch([(9 + 11 * i + seed, 1) for i in range(real)], None, kv_heads, dtype, device, seed,
                           kv_pool)
        reference = Reference(batch)
        padded = pad_decode_batch(batch, size)
        padded.out_cache_loc = static_loc.copy_(padded.out_cache_loc)
        backend.init_forward_metadata_graph(padded)
        backend.begin_forward(padded)
        return reference

    def layers() -> list[torch.Tensor]:
        return [backend.forward(*static_qkv[layer], layer, SCALING, window)
                for layer, window in enumerate(layer_windows)]

    prepare(seed=0, real=size)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layers()  # warm up: kernels compiled and loaded before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layers()
    for seed, real in [(1, 4), (2, 3), (3, 1)]:
        reference = prepare(seed, real)
        for layer, (q, k, v) in enumerate(static_qkv):
            fresh = random_qkv(size, kv_heads, dtype, device, seed=100 * seed + layer)
            for static, new in zip((q, k, v), fresh):
                static.copy_(new)
        graph.replay()
        for layer, window in enumerate(layer_windows):
            q, k, v = static_qkv[layer]
            expected = reference.forward(q[:real], k[:real], v[:real], layer, window)
            torch.testing.assert_close(outputs[layer][:real].float().cpu(), expected, **TOLERANCE[dtype])


def _tiny_model_with_flashinfer_shapes(arch: str, root: Path) -> Path:
    """A tiny model FlashInfer can run (head_dim 64) with a word-per-id tokenizer of its own, so the test needs
    neither the default model nor the network."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import build_tiny_model

    vocab = 512
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer_dir = root / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="w1", eos_token="w2").save_pretrained(tokenizer_dir)
    return build_tiny_model(arch, root / arch, tokenizer_dir, head_dim=64, vocab_size=vocab)


# Largest |logprob difference| against HF in the same dtype on the same device (tests/test_bf16.py measures the same
# on CPU); near-ties are where bfloat16 may legitimately pick another greedy token.
LOGPROB_TOLERANCE = 0.05
ENGINES = [
    pytest.param("cuda", "flashinfer", torch.bfloat16, marks=needs_gpu, id="cuda-flashinfer-bf16"),
    # The same check with the reference backend on CPU, so the test itself is exercised everywhere.
    pytest.param("cpu", "torch_native", torch.float32, id="cpu-torch_native-f32"),
]


@pytest.mark.parametrize("device, backend, dtype", ENGINES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: every layer windowed, prompts past the window
def test_engine_agrees_with_hf(arch, device, backend, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    from furcate import Engine

    model_dir = _tiny_model_with_flashinfer_shapes(arch, tmp_path)
    dtype_name = str(dtype).removeprefix("torch.")
    prompts = [[1] + [(37 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 30, 61, 90])]
    with Engine(str(model_dir), device=device, attention_backend=backend, dtype=dtype_name, quantization="none",
                grammar_backend="none", max_total_tokens=2000, torch_num_threads=2) as engine:
        assert engine.info.dtype == dtype_name
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                   "ignore_eos": True},
                               return_logprob=True, logprob_start_len=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    for prompt, out in zip(prompts, outs):
        ids = prompt + out["output_ids"]
        with torch.inference_mode():
            reference = torch.log_softmax(hf(torch.tensor([ids], device=device)).logits[0].float(), -1).cpu()
        for position, (logprob, token, _) in enumerate(out["meta_info"]["input_token_logprobs"], start=1):
            assert abs(logprob - reference[position - 1, token].item()) < LOGPROB_TOLERANCE
        for step, token in enumerate(out["output_ids"]):  # greedy: HF's argmax, or within a near-tie of it
            row = reference[len(prompt) + step - 1]
            assert row.max().item() - row[token].item() < LOGPROB_TOLERANCE
