"""RMSNorm references: the zero-centred block norm (alone and fused with the residual add) and the
gated per-head norm of GDN.

Both compute in at least float32 (float64 stays float64) and return the input dtype, rounding
where Hugging Face's reference rounds so that bfloat16 runs agree with it.
"""

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, reduced over the last dim."""
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.to(acc))).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next block norm: `s = residual + x` (rounded to x's dtype),
    returns (rms_norm(s), s)."""
    total = residual + x
    return rms_norm(total, weight, eps), total


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm per head: `w * norm(x) * silu(gate)` (plain weight, not zero-centred)."""
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.to(acc))).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` over the last dim, in the compute dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
