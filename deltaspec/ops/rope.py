"""Rotary position embedding reference: NeoX-style (rotate-half) on the first `rotary_dim` dims, alone
and after the zero-centred RMSNorm that gated attention applies to q and k first (`norm_rope`).

Qwen3.5's text-only M-RoPE has equal temporal/height/width positions, which is exactly 1-D RoPE.
"""

import torch

from deltaspec.ops.norms import compute_dtype


def inv_frequencies(rotary_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
    """`1 / theta^(2i / rotary_dim)` for i < rotary_dim / 2.  # [rotary_dim // 2]"""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / rotary_dim
    return 1.0 / (theta**exponents)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` [T], each [T, rotary_dim], cast to `dtype`."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dims of x [T, heads, head_dim]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((rot * c + rotated_half * s, rest), dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """`apply_rope(rms_norm(x, weight, eps), cos, sin)` for x [T, heads, head_dim] (q or k of gated
    attention), computed in float32 (float64 for float64 inputs) and rounded to x's dtype once, at the
    end: the rotation uses the unrounded norm. (Rounding in between makes a fused kernel's result
    depend on whether its compiler keeps float32 -> bfloat16 -> float32 round trips.)"""
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(acc))
    return apply_rope(normed, cos.to(acc), sin.to(acc)).to(x.dtype)
