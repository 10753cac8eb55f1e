"""The fused q/k RMSNorm + RoPE kernel against its torch reference (`deltaspec.ops.rope.norm_rope`)."""

import pytest
import torch

from deltaspec.ops import norms, rope

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim, rotary", [(24, 256, 64), (3, 80, 80), (2, 16, 8)])
def test_norm_rope_matches_the_reference_on_a_strided_view(kernel_device, dtype, heads, head_dim, rotary):
    torch.manual_seed(heads)
    tokens = 5
    projected = torch.randn(tokens, heads, 2 * head_dim, device=kernel_device).to(dtype)
    x = projected[..., :head_dim]  # the query half of q_proj's output: a strided view
    weight = (0.3 * torch.randn(head_dim, device=kernel_device)).to(dtype)
    inv_freq = rope.inv_frequencies(rotary, 10_000.0, torch.float32, kernel_device)
    cos, sin = rope.cos_sin(torch.arange(7, 7 + tokens, device=kernel_device), inv_freq, dtype)
    from deltaspec.ops.triton import rope as triton_rope

    got = triton_rope.norm_rope(x, weight, cos, sin, 1e-6)
    expected = rope.norm_rope(x, weight, cos, sin, 1e-6)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # the interpreter truncates float32 -> bfloat16 casts; the GPU rounds like torch
        tolerance = 1.6e-2 if kernel_device == "cuda" else 4e-2
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        if kernel_device == "cuda":
            assert (got == expected).float().mean().item() > 0.99
    assert not torch.equal(got[..., :rotary], norms.rms_norm(x, weight, 1e-6)[..., :rotary])  # it rotated
