"""Rotary position embedding reference: NeoX-style (rotate-half) on the first `rotary_dim` dims, alone
and after the zero-centred RMSNorm that gated attention applies to q and k first (`norm_rope`).

Qwen3.5's text-only M-RoPE has equal temporal/height/width positions, which is exactly 1-D RoPE. `YarnScaling`
gives YaRN's scaled frequencies (the block drafters of Qwen3.6 targets use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaspec.ops.norms import compute_dtype


def inv_frequencies(rotary_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
    """`1 / theta^(2i / rotary_dim)` for i < rotary_dim / 2.  # [rotary_dim // 2]"""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(dtype) / rotary_dim
    return 1.0 / (theta**exponents)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` [T], each [T, rotary_dim], times `scale` (YaRN's), cast to `dtype`."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE scaling (arXiv 2309.00071, as transformers computes it): frequencies whose wavelength is short
    against the original context are kept, long ones are divided by `factor`, a linear ramp between, and cos / sin
    scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: 0.1 * ln(factor) + 1 (or the mscale ratio below)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, scaling: dict, max_position_embeddings: int) -> YarnScaling:
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor") or max_position_embeddings / original
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            attention_factor=scaling.get("attention_factor"),
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            truncate=bool(scaling.get("truncate", True)),
        )

    def scale(self) -> float:
        """The factor cos and sin are multiplied by."""

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def inv_frequencies(self, rotary_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
        """The scaled `1 / theta^(2i / rotary_dim)`.  # [rotary_dim // 2]"""
        plain = inv_frequencies(rotary_dim, theta, dtype, device)

        def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return rotary_dim * math.log(turns) / (2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(rotary_dim // 2, dtype=dtype, device=device) - low) / (high - low)).clamp(0, 1)
        return plain / self.factor * ramp + plain * (1 - ramp)
