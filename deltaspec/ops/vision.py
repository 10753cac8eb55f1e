"""Vision-tower references: LayerNorm, the tower's 2-D (axial) rotary tables, and bidirectional attention within
each frame.

The rotary embedding gives each patch a (row, column) position: the head's first quarter of frequency pairs turns
with the row, the second with the column (`1 / theta^(2i / (D/2))` for i < D/4 on both axes), laid out
`[row | column | row | column]` over the head for rotate-half. The tables and the rotation run in float32 (float64
for float64), like transformers', and the result rounds once to the input's dtype.
"""

import torch
import torch.nn.functional as F

from deltaspec.ops.norms import compute_dtype
from deltaspec.ops.rope import apply_rope


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps) * w + b` over the last dim, in x's dtype as torch's LayerNorm computes it."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def axial_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for (row, column) `positions` [N, 2] and `inv_freq` [D/4], each [N, D] in inv_freq's dtype."""
    freqs = positions.to(inv_freq.dtype)[:, :, None] * inv_freq  # [N, 2, D/4]
    emb = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)  # [N, D/2]
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos(), emb.sin()


def rope_in_compute_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the whole head of x [N, heads, D], computed in float32 (float64) and rounded once."""
    acc = compute_dtype(x.dtype)
    return apply_rope(x.to(acc), cos.to(acc), sin.to(acc)).to(x.dtype)


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention of q, k, v [N, heads, D] within each run of `lengths` rows (a frame of one image),
    scaled by D^-0.5; returns [N, heads * D]."""
    outputs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))  # [H, n, D]
        outputs.append(o.transpose(0, 1).reshape(o.shape[1], -1))
    return torch.cat(outputs)
