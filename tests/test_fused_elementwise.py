"""The fused elementwise kernels (fused_elementwise.c) against the torch ops they replace in eager CPU float32
forwards: rotary to torch's bits, the SiLU-gated product within a few ulps, RMSNorm within
the rounding of a differently ordered sum; in bfloat16, torch's bfloat16 ops' roundings (rotary to the bit, the
others but for the rare value a float32 ulp tips to the other bfloat16)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from furcate.runtime.kernels import fused_elementwise
from furcate.runtime.model.layers import GatedMLP, RMSNorm
from furcate.runtime.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not fused_elementwise.available(),
                                reason=f"kernels: {fused_elementwise.library()}")


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows, width", [(0, 576), (1, 576), (3, 17), (2048, 576), (5, 2048), (40, 1)])
def test_rms_norm_equals_torchs_within_a_sums_rounding(rows, width):
    generator = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=generator) * 3
    weight = torch.randn(width, generator=generator)
    got = fused_elementwise.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, torch_norm(x, weight, 1e-5), rtol=2e-6, atol=1e-7)


def test_rms_norm_keeps_huge_and_tiny_rows_finite():
    x = torch.tensor([[3e18, -3e18, 1.0], [1e-30, 0.0, -1e-30], [0.0, 0.0, 0.0]])
    got = fused_elementwise.rms_norm(x, torch.ones(3), 1e-6)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch_norm(x.double(), torch.ones(3).double(), 1e-6).float())


@pytest.mark.parametrize("rows, inter", [(0, 8), (1, 1536), (7, 13), (2048, 1536)])
def test_silu_mul_equals_torchs_within_ulps(rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(fused_elementwise.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-7, atol=1e-30)


def test_silu_mul_saturates_as_torch_does():
    gate_up = torch.tensor([[-200.0, 200.0, 0.0, -88.8, 2.0, 2.0, 2.0, 2.0]])
    gate, up = gate_up.split(4, dim=-1)
    assert torch.equal(fused_elementwise.silu_mul(gate_up), F.silu(gate) * up)


def test_nan_and_infinities_pass_through_as_torchs_do():
    gate_up = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, 2.0, 2.0, 2.0, 2.0]])
    gate, up = gate_up.split(4, dim=-1)
    torch.testing.assert_close(fused_elementwise.silu_mul(gate_up), F.silu(gate) * up, equal_nan=True)
    x = torch.tensor([[float("nan"), 1.0], [float("inf"), 1.0]])
    torch.testing.assert_close(fused_elementwise.rms_norm(x, torch.ones(2), 1e-6), torch_norm(x, torch.ones(2), 1e-6),
                               equal_nan=True)


@pytest.mark.parametrize("q_heads, k_heads, dim, rot", [(9, 3, 64, 64), (32, 8, 128, 128), (4, 4, 16, 16),
                                                       (8, 2, 64, 32), (2, 1, 80, 40)])
def test_rotary_equals_apply_rotary_bit_for_bit(q_heads, k_heads, dim, rot):
    rows = 37
    generator = torch.Generator().manual_seed(dim + rot)
    qkv = torch.randn(rows, (q_heads + 2 * k_heads) * dim, generator=generator)  # v's columns follow q and k
    angles = torch.randn(rows, 1, rot // 2, generator=generator) * 50
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    q, k = fused_elementwise.rotary_qk(qkv, cos, signed_sin, q_heads, k_heads, dim)
    qk = apply_rotary(qkv[:, : (q_heads + k_heads) * dim].reshape(rows, -1, dim), cos, signed_sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, qk[:, :q_heads]) and torch.equal(k, qk[:, q_heads:])


def bf16_hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm on bfloat16 rows and weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)


def mostly_equal(got: torch.Tensor, expected: torch.Tensor, share: float = 0.995) -> None:
    """bfloat16 results: torch's bits but for the few values a float32 ulp moved across a rounding boundary
    (one bfloat16 step away)."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    same = got == expected
    assert same.float().mean() >= share if got.numel() else True
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-30)


@pytest.mark.parametrize("rows, width", [(1, 576), (3, 17), (2048, 576)])
def test_bfloat16_rms_norm_rounds_as_hfs(rows, width):
    generator = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=generator) * 3).bfloat16()
    weight = torch.randn(width, generator=generator).bfloat16()
    mostly_equal(fused_elementwise.rms_norm(x, weight, 1e-5), bf16_hf_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 13), (2048, 1536)])
def test_bfloat16_silu_mul_rounds_as_torchs(rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = gate_up.split(inter, dim=-1)
    mostly_equal(fused_elementwise.silu_mul(gate_up), F.silu(gate) * up)


def test_bfloat16_nan_and_infinities_pass_through():
    gate_up = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, 2.0, 2.0, 2.0, 2.0]]).bfloat16()
    gate, up = gate_up.split(4, dim=-1)
    assert torch.equal(fused_elementwise.silu_mul(gate_up).isnan(), (F.silu(gate) * up).isnan())
    x = torch.tensor([[float("nan"), 1.0], [3e38, -3e38]]).bfloat16()
    got, expected = fused_elementwise.rms_norm(x, torch.ones(2).bfloat16(), 1e-6), bf16_hf_norm(
        x, torch.ones(2).bfloat16(), 1e-6)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("q_heads, k_heads, dim, rot", [(9, 3, 64, 64), (8, 2, 64, 32), (2, 1, 80, 40)])
def test_bfloat16_rotary_equals_apply_rotary_bit_for_bit(q_heads, k_heads, dim, rot):
    rows = 37
    generator = torch.Generator().manual_seed(dim + rot)
    qkv = torch.randn(rows, (q_heads + 2 * k_heads) * dim, generator=generator).bfloat16()
    angles = torch.randn(rows, 1, rot // 2, generator=generator) * 50
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).bfloat16()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).bfloat16()
    q, k = fused_elementwise.rotary_qk(qkv, cos, signed_sin, q_heads, k_heads, dim)
    qk = apply_rotary(qkv[:, : (q_heads + k_heads) * dim].reshape(rows, -1, dim), cos, signed_sin)
    assert q.dtype == torch.bfloat16 and q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, qk[:, :q_heads]) and torch.equal(k, qk[:, q_heads:])


def test_layers_take_the_kernels_only_where_they_serve():
    norm = RMSNorm(8, 1e-6)
    norm.weight.data = torch.randn(8)
    x = torch.randn(5, 8)
    assert fused_elementwise.serves(x) and fused_elementwise.serves(x.bfloat16())
    assert not fused_elementwise.serves(x.half()) and not fused_elementwise.serves(x.double())
    torch.testing.assert_close(norm(x), torch_norm(x, norm.weight.detach(), 1e-6), rtol=2e-6, atol=1e-7)
    assert not norm.fuses(x.bfloat16())  # a float32 weight on bfloat16 rows: torch's ops
    assert torch.equal(norm(x.bfloat16()), norm.weight * (x.bfloat16().float() * torch.rsqrt(
        x.bfloat16().float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16())
    olmo = RMSNorm(8, 1e-6, "olmo").bfloat16()
    assert norm.bfloat16().fuses(x.bfloat16()) and not olmo.fuses(x.bfloat16())  # OLMo rounds after the weight
    mlp = GatedMLP(8, 12)
    gate, up = mlp.gate_up_proj(x).split(12, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(gate) * up), rtol=1e-6, atol=1e-7)


def test_turned_off_by_its_variable():
    code = "from furcate.runtime.kernels import fused_elementwise as f; print(f.available(), f.library())"
    env = {**os.environ, "FURCATE_FUSED_ELEMENTWISE": "0"}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "False turned off by FURCATE_FUSED_ELEMENTWISE=0"
