"""Triton norms, SwiGLU activation and skinny GEMM against their torch references (the spec)."""

import pytest
import torch
import torch.nn.functional as F

from deltaspec.ops import activation, norms
from tests.conftest import triton_interpreted

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

DTYPES = [torch.float32, torch.bfloat16]


def tolerances(dtype: torch.dtype) -> dict:
    """About one ulp for 16-bit dtypes; tight for fp32."""
    return {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}.get(
        dtype, {"rtol": 1e-5, "atol": 1e-5}
    )


def assert_rounds_like(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel and reference round at the same points, so they agree within an ulp everywhere and, on
    the GPU, bit for bit almost everywhere (only the reduction order differs). Triton's interpreter
    casts float32 to bfloat16 by truncation, so the bitwise check runs on CUDA only."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.is_cuda or got.dtype != torch.bfloat16:
        torch.testing.assert_close(got, expected, **tolerances(got.dtype))
    else:  # up to three truncations (gated norm) instead of round-to-nearest
        torch.testing.assert_close(got, expected, rtol=3.2e-2, atol=1e-2)
    if got.is_cuda and got.dtype != torch.float32:  # float32 reductions in another order differ in the last bit
        assert (got == expected).float().mean().item() > 0.99


@pytest.fixture
def triton_ops():
    from deltaspec.ops.triton import activation as triton_activation
    from deltaspec.ops.triton import norms as triton_norms
    from deltaspec.ops.triton import skinny_gemm

    return triton_norms, triton_activation, skinny_gemm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 8192), (4, 3, 96)])
def test_rms_norm(triton_ops, kernel_device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=kernel_device).to(dtype)
    weight = torch.randn(shape[-1], device=kernel_device).to(dtype)
    assert_rounds_like(triton_ops[0].rms_norm(x, weight, 1e-6), norms.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(triton_ops, kernel_device, dtype):
    """q_norm reads the query half of q_proj's [T, heads, 2 * head_dim] output (a strided view)."""
    torch.manual_seed(1)
    projected = torch.randn(6, 4, 2 * 80, device=kernel_device).to(dtype)  # [T, heads, 2 * head_dim]
    query = projected[..., :80]  # [T, heads, head_dim], row stride 160
    weight = torch.randn(80, device=kernel_device).to(dtype)
    assert_rounds_like(triton_ops[0].rms_norm(query, weight, 1e-6), norms.rms_norm(query, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 4096])
def test_add_rms_norm(triton_ops, kernel_device, dtype, hidden):
    torch.manual_seed(2)
    x = torch.randn(7, hidden, device=kernel_device).to(dtype)
    residual = torch.randn(7, hidden, device=kernel_device).to(dtype) * 4
    weight = torch.randn(hidden, device=kernel_device).to(dtype)
    expected_out, expected_total = norms.add_rms_norm(x, residual, weight, 1e-6)
    got_out, got_total = triton_ops[0].add_rms_norm(x, residual, weight, 1e-6)
    assert_rounds_like(got_total, expected_total)
    assert_rounds_like(got_out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(triton_ops, kernel_device, dtype, weight_dtype):
    torch.manual_seed(3)
    t, heads, dv = 5, 6, 128
    x = torch.randn(t, heads, dv, device=kernel_device).to(dtype)  # [T, Hv, Dv]
    projected = torch.randn(t, heads * dv + 32, device=kernel_device).to(dtype)
    gate = projected[:, 32:].view(t, heads, dv)  # a view into a wider projection output
    weight = (1 + 0.5 * torch.randn(dv, device=kernel_device)).to(weight_dtype)
    assert_rounds_like(triton_ops[0].gated_rms_norm(x, gate, weight, 1e-6), norms.gated_rms_norm(x, gate, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 96), (2, 5, 2 * 1536)])
def test_silu_mul(triton_ops, kernel_device, dtype, shape):
    torch.manual_seed(4)
    gate_up = (3 * torch.randn(shape, device=kernel_device)).to(dtype)
    assert_rounds_like(triton_ops[1].silu_mul(gate_up), activation.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows, use_dot",
    [(1, False), (1, True), (3, False), (3, True), (33, True)],
    ids=["1-fma", "1-dot", "3-fma", "3-dot", "33-dot"],
)
@pytest.mark.parametrize("n, k", [(72, 288)])
def test_skinny_linear_every_config(triton_ops, kernel_device, dtype, rows, use_dot, n, k):
    """Every configuration the routing table may pick (it routes 16-bit weights only), against F.linear,
    the fma and the dot ones separately (no fma configuration handles 33 rows)."""
    if triton_interpreted() and dtype == torch.bfloat16 and use_dot:
        pytest.skip("Triton's interpreter multiplies bfloat16 tl.dot operands as their raw uint16 storage")
    skinny_gemm = triton_ops[2]
    torch.manual_seed(5)
    x = torch.randn(rows, k, device=kernel_device).to(dtype)
    weight = (torch.randn(n, k, device=kernel_device) / k**0.5).to(dtype)
    expected = F.linear(x.float(), weight.float()).to(dtype)
    configs = [config for config in skinny_gemm.configs_for(rows) if config.use_dot == use_dot]
    assert configs
    for config in configs:
        got = skinny_gemm.skinny_linear(x, weight, config)
        assert got.shape == (rows, n) and got.dtype == dtype
        torch.testing.assert_close(got, expected, **tolerances(dtype), msg=f"config {config.name}")


def test_skinny_configs_offered_by_rows(triton_ops):
    skinny_gemm = triton_ops[2]
    assert all(config.use_dot for config in skinny_gemm.configs_for(64))
    assert any(not config.use_dot for config in skinny_gemm.configs_for(1))
    assert len(skinny_gemm.CONFIGS_BY_NAME) == len(skinny_gemm.SKINNY_CONFIGS)
