"""block_gemv.c on every vector path this CPU can run (AVX512-VNNI, AVX2, plain C): GGUF blocks times activations
coded as two int8 digits equal a float64 matmul of the dequantized weights to float32 noise, for 4- and 8-bit
blocks, with stored offsets (Q4_1) or offsets derived from the scales (Q4_0, Q8_0: symmetric rows), float32 and
bfloat16 activations, any row count and rows that do not fill a block; files whose factors are no float16 numbers
and machines without a compiler keep torch's kernels."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from furcate.runtime.kernels import block_gemv, native_build
from furcate.runtime.model.weights.quantized import (
    BlockGemvLinear,
    BlockWeights,
    Int4Linear,
    Int8Linear,
    SmallBatchQuantized,
    quantized_linear,
)

pytestmark = pytest.mark.skipif(not block_gemv.available(), reason=f"no block GEMV kernel: {block_gemv.isa()}")

CPU_FLAGS = set(native_build.cpu_signature().split())
# extra compiler flags -> the path that build takes on this CPU (-march=native picks the widest it has)
BUILDS = {(): None, ("-mno-avx512f",): "AVX2", ("-mno-avx", "-mno-avx2"): "plain C"}


def builds() -> list[tuple[str, ...]]:
    usable = [()]
    if "avx512_vnni" in CPU_FLAGS and {"avx2", "fma", "f16c"} <= CPU_FLAGS:
        usable.append(("-mno-avx512f",))
    return [*usable, ("-mno-avx", "-mno-avx2")]


def random_blocks(kind: str, n: int, k: int, seed: int) -> BlockWeights:
    rng = np.random.default_rng(seed)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return BlockWeights(kind, rng.integers(-127, 128, (n, k)).astype(np.int32), scale, np.zeros_like(scale))
    # Q4_0 as GGUF decodes it (read_blocks): -8 scales, so its rows pack symmetric.
    offset = -8 * scale if kind == "Q4_0" else (rng.normal(size=scale.shape) * 0.02).astype(np.float16).astype(
        np.float32)
    return BlockWeights(kind, rng.integers(0, 16, (n, k)).astype(np.int32), scale, offset)


@pytest.fixture(scope="module", params=builds(), ids=lambda flags: " ".join(flags) or "native")
def kernel(request, tmp_path_factory):
    os.environ["FURCATE_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    try:
        lib = block_gemv.load(request.param)
    finally:
        del os.environ["FURCATE_CACHE"]
    expected = BUILDS[request.param]
    if expected is not None:
        assert block_gemv.ISA_NAMES[lib.block_gemv_isa()] == expected
    return lib.block_gemv


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("n, k", [(13, 64), (96, 576), (35, 1536)])
def test_the_kernel_equals_a_matmul_of_the_dequantized_weights(kernel, kind, rows, n, k):
    blocks = random_blocks(kind, n, k, seed=rows + n)
    layer = BlockGemvLinear(blocks, None)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    x[0, 3] = 40.0  # an outlier in one group: the other 31 keep their precision through the second digit
    reference = x.double() @ blocks.dequantize().double().T
    assert layer.symmetric == (kind != "Q4_1")
    got = block_gemv.gemv(x, layer.packed, n, layer.bits, layer.symmetric, kernel)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # The second digit's step is 1/16256 of a group's largest activation: float32-level error, not int8's.
    assert (got.double() - reference).abs().max() <= 1e-3 * reference.abs().max()
    rounded = block_gemv.gemv(x.bfloat16(), layer.packed, n, layer.bits, layer.symmetric, kernel)
    expected = x.bfloat16().double() @ blocks.dequantize().double().T
    assert rounded.dtype == torch.bfloat16
    assert (rounded.double() - expected).abs().max() <= 8e-3 * expected.abs().max()  # the bfloat16 result


@pytest.mark.parametrize("kind, bits_per_weight", [("Q4_0", 4.5), ("Q8_0", 8.5)])
def test_symmetric_rows_read_the_gguf_bytes_and_compute_what_stored_offsets_do(kernel, kind, bits_per_weight):
    """Q4_0's and Q8_0's offsets are -8 and -128 scales: left out, a row is the GGUF's size (Q4_1's 5 bits a
    weight would be 11% more for Q4_0), and the kernel, which then takes scale * (dx * dot - zero * sum) per group,
    computes what it does with the offsets stored, to float32 rounding (the bfloat16 result's own rounding)."""
    blocks = random_blocks(kind, 40, 576, seed=3)
    unsigned, offset = BlockGemvLinear.unsigned(blocks)
    bits = 4 if kind == "Q4_0" else 8
    assert block_gemv.symmetric(blocks.scale, offset, bits)
    compact = block_gemv.pack(unsigned, blocks.scale, offset, bits, symmetric=True)
    stored = block_gemv.pack(unsigned, blocks.scale, offset, bits)
    assert compact.numel() * 8 == 40 * 576 * bits_per_weight < stored.numel() * 8
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        x = torch.randn(3, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = block_gemv.gemv(x, compact, 40, bits, True, kernel).double()
        expected = block_gemv.gemv(x, stored, 40, bits, False, kernel).double()
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    one_off = offset.copy()
    one_off[7, 2] += blocks.scale[7, 2]  # one group whose offset is not -2^(bits-1) scales keeps stored offsets
    assert not block_gemv.symmetric(blocks.scale, one_off, bits)


def test_the_module_keeps_shape_dtype_and_bias():
    blocks = random_blocks("Q4_1", 64, 128, seed=0)
    bias = torch.randn(64)
    layer = BlockGemvLinear(blocks, bias)
    x = torch.randn(2, 3, 128)
    got = layer(x)
    assert got.shape == (2, 3, 64) and got.dtype == torch.float32
    expected = x.double() @ blocks.dequantize().double().T + bias.double()
    assert (got.double() - expected).abs().max() <= 2e-4 * expected.abs().max()
    half = BlockGemvLinear(blocks, None)(x.to(torch.float16))  # other dtypes run in float32 and come back
    assert half.dtype == torch.float16 and torch.isfinite(half).all()


def test_quantized_layers_take_the_kernel_where_it_fits():
    assert isinstance(quantized_linear(random_blocks("Q4_1", 16, 128, 0), None), BlockGemvLinear)
    assert isinstance(quantized_linear(random_blocks("Q8_0", 16, 128, 0), None), BlockGemvLinear)
    odd_groups = random_blocks("Q4_1", 16, 96, 0)  # three groups: not whole pairs
    assert isinstance(quantized_linear(odd_groups, None), Int4Linear)


def test_factors_beyond_float16_keep_torch_kernels():
    """A Q8_0 scale over 511 puts its offset (-128 scales) past float16's range: the layer stays exact on
    torch's int8 kernel rather than computing with an infinity."""
    blocks = random_blocks("Q8_0", 16, 128, 0)
    blocks.scale[3, 1] = 600.0
    layer = quantized_linear(blocks, None)
    assert isinstance(layer, Int8Linear)
    assert torch.isfinite(layer(torch.randn(1, 128))).all()


def test_torch_compile_traces_the_registered_op():
    layer = SmallBatchQuantized(BlockGemvLinear(random_blocks("Q4_0", 32, 256, 1), None),
                                torch.nn.Linear(256, 32), 4)
    x = torch.randn(1, 256)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), layer(x))


def test_without_a_cpp_compiler_the_ops_run_their_python_kernels(tmp_path):
    """The C kernels build, the ops' C++ kernels cannot: every op computes the same through its Python kernel, and
    compiled decode keeps torch's int4 kernel for 4-bit layers."""
    script = ("import torch\n"
              "from furcate.runtime.kernels import block_gemv, paged_attention\n"
              "from furcate.runtime.model import packed_linear\n"
              "from furcate.runtime.model.weights import quantized\n"
              "import numpy as np\n"
              "w = quantized.BlockWeights('Q4_1', np.ones((16, 64), np.int32), np.ones((16, 2), np.float32),"
              " np.zeros((16, 2), np.float32))\n"
              "layer = quantized.quantized_linear(w, None, for_graphs=True)\n"
              "print(block_gemv.native_op(), paged_attention.available() and paged_attention.native_op(),"
              " packed_linear.native_kernel(), type(layer).__name__)\n"
              "g = quantized.BlockGemvLinear(w, None)\n"
              "x = torch.randn(2, 64)\n"
              "print(torch.equal(block_gemv.gemv_op(x, g.packed, 16, 4, False),"
              " block_gemv.gemv(x, g.packed, 16, 4)))\n"
              "q, k, v = torch.randn(1, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16)\n"
              "spans = paged_attention.spans(torch.tensor([0]), torch.tensor([1]), torch.tensor([4]))\n"
              "table = torch.arange(8).view(1, 8)\n"
              "print(torch.equal(paged_attention.attention_op(q, k, v, table, spans, 0.25),"
              " paged_attention.attention(q, k, v, table, spans, 0.25)))\n"
              "model = torch.nn.Sequential(torch.nn.Linear(64, 32))\n"
              "packed_linear.pack_linears(model)\n"
              "print(torch.equal(packed_linear.packed_linear_op(x, model[0].weight, model[0].bias), model[0](x)))\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "FURCATE_PACKED_LINEAR": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          cwd=pathlib.Path(__file__).parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["False False False Int4Linear", "True", "True", "True"]
    assert "furcate::block_gemv runs its Python kernel" in done.stderr


def test_without_a_compiler_the_engine_keeps_torch_kernels(tmp_path):
    script = ("from furcate.runtime.kernels import block_gemv\n"
              "from furcate.runtime.model.weights import quantized\n"
              "import numpy as np\n"
              "print(block_gemv.available(), block_gemv.isa()[:26])\n"
              "w = quantized.BlockWeights('Q4_1', np.zeros((16, 64), np.int32), np.ones((16, 2), np.float32),"
              " np.zeros((16, 2), np.float32))\n"
              "print(type(quantized.quantized_linear(w, None)).__name__)\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "FURCATE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          cwd=pathlib.Path(__file__).parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False could not build or load it", "Int4Linear"]
    assert "block GEMV kernel unavailable" in done.stderr


def test_weights_of_the_wrong_size_are_refused_before_the_kernel_reads_them():
    layer = BlockGemvLinear(random_blocks("Q4_1", 16, 128, 0), None)
    layer.packed = layer.packed.new_empty(0)  # what releasing memory leaves behind
    with pytest.raises(ValueError, match="weights released"):
        layer(torch.randn(1, 128))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_gives_the_eager_calls_bits(kind, rows, dtype):
    """furcate::block_gemv, as a compiled step calls it (block_gemv_op.cpp's kernel where it builds), computes
    what the eager ctypes call does."""
    layer = BlockGemvLinear(random_blocks(kind, 35, 576, seed=rows), None)
    args = (35, layer.bits, layer.symmetric)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert torch.equal(block_gemv.gemv_op(x, layer.packed, *args), block_gemv.gemv(x, layer.packed, *args))
    wide = torch.randn(rows, 1152).to(dtype)[:, ::2]  # a strided view is read as the values it shows
    assert torch.equal(block_gemv.gemv_op(wide, layer.packed, *args),
                       block_gemv.gemv(wide.contiguous(), layer.packed, *args))


def test_the_op_refuses_what_it_cannot_read():
    layer = BlockGemvLinear(random_blocks("Q4_1", 16, 128, 0), None)
    for x, weight, bits, symmetric, message in (
            (torch.randn(1, 128), layer.packed.new_empty(0), 4, False, "weights released"),
            (torch.randn(1, 128), layer.packed, 8, False, "not the"),
            (torch.randn(1, 128), layer.packed, 4, True, "not the"),  # stored offsets read as symmetric rows
            (torch.randn(1, 128).double(), layer.packed, 4, False, "float32 or bfloat16"),
            (torch.randn(2, 1, 128), layer.packed, 4, False, "float32 or bfloat16"),
            (torch.randn(1, 96), layer.packed, 4, False, "multiple of 64"),
            (torch.randn(1, 128), layer.packed, 3, False, "4- or 8-bit")):
        with pytest.raises(ValueError, match=message):
            block_gemv.gemv_op(x, weight, 16, bits, symmetric)


def test_compiled_decode_takes_the_block_kernel_where_its_op_runs_in_cpp():
    """With the op's C++ kernel a compiled step reads 4-bit blocks through it; without it (the op's Python
    kernel cost more a call than it saved) torch's int4 kernel, checked in a process with no C++ compiler."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the op runs its Python kernel (the test below covers that)")
    assert block_gemv.native_op(), "this machine has a C++ compiler: the op's C++ kernel should build"
    assert isinstance(quantized_linear(random_blocks("Q4_1", 16, 128, 0), None, for_graphs=True), BlockGemvLinear)
    assert isinstance(quantized_linear(random_blocks("Q8_0", 16, 128, 0), None, for_graphs=True), BlockGemvLinear)
