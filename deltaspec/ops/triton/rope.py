"""Triton kernel of `deltaspec.ops.rope.norm_rope`: gated attention's q/k RMSNorm and partial NeoX RoPE in
one launch, in float32 with one rounding at the end, as the reference.

Grid (tokens, heads): a program loads one head's row twice (at d and at its rotation partner d +- R/2),
normalises both in float32 with the row's one scale, and writes the rotated row. x may be a strided view
(q is the first half of q_proj's [T, heads, 2 * head_dim] output); cos and sin are [T, R] contiguous.
"""

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    dim,
    rotary,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    eps,
    BLOCK_D: tl.constexpr,
):
    pdl.wait_for_previous()
    token, head = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    inside = cols < dim
    half = rotary // 2
    partner = tl.where(cols < half, cols + half, cols - half)  # rotation partner of each rotated dim
    row = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(row + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = x * rstd * (1.0 + weight)  # [BLOCK_D]
    rotated = cols < rotary
    x_partner = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32)
    weight_partner = tl.load(weight_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    normed_partner = x_partner * rstd * (1.0 + weight_partner)
    rotate_half = tl.where(cols < half, -normed_partner, normed_partner)
    cos = tl.load(cos_ptr + token * rotary + cols, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * rotary + cols, mask=rotated, other=0.0).to(tl.float32)
    out = tl.where(rotated, normed * cos + rotate_half * sin, normed)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, heads, head_dim] (last dim contiguous) -> RMSNorm (zero-centred weight) then RoPE on the first
    cos.shape[-1] dims, [T, heads, head_dim] in x's dtype."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        _norm_rope_kernel[(tokens, heads)](
            x,
            weight,
            cos,
            sin,
            out,
            dim,
            cos.shape[-1],
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            eps,
            BLOCK_D=triton.next_power_of_2(dim),
            **pdl.LAUNCH,
        )
    return out
