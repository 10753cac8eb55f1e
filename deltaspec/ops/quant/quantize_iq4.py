"""Quantizers of the non-linear 4-bit types IQ4_NL (32-element blocks) and IQ4_XS (256-element super-blocks).

Both are ggml's `quantize_row_iq4_nl_impl` as `quantize_iq4_nl` / `quantize_iq4_xs` call it (ntry = 7), with
or without importance. Note that `quantize_row_iq4_nl_ref` differs (ntry = -1: no scale search); llama-quantize
never calls it, so it is not reproduced. Each function maps rows x [R, C] float32 to blocks uint8.
"""

import numpy as np
import torch

from deltaspec.ops.quant.dequant import IQ4_NL_LEVELS
from deltaspec.ops.quant.quantize_search import (
    GROUP_MAX_EPS,
    best_index,
    div,
    fp16_bytes,
    nearest_int,
    seq_sum,
    signed_absmax,
    sqrt,
)

NTRY = 7


def _block_scales(xb: torch.Tensor, weights: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The per-block scale search of quantize_row_iq4_nl_impl (ntry = 7) for blocks xb [32, B] -> d [B],
    0 for a block below GROUP_MAX_EPS."""
    xmax = signed_absmax(xb)
    zero = xmax.abs() < GROUP_MAX_EPS
    first = np.float32(levels[0].item())

    def trial(inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = levels[best_index(levels, inv * xb)]
        wq = weights * q
        sumqx, sumq2 = seq_sum(torch.stack([wq * xb, wq * q], dim=1)).unbind(0)
        return sumqx, sumq2

    d = div(-xmax, float(first))
    sumqx, sumq2 = trial(div(1.0, d))
    d = torch.where(sumq2 > 0, div(sumqx, sumq2), 0.0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = trial(div(float(itry + first), xmax))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, div(sumqx, sumq2), d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(zero, 0.0, d)


def _weights(xb: torch.Tensor, importance: torch.Tensor | None, group: int) -> torch.Tensor:
    """x² without importance, else `qw * sqrtf(sigma2 + x²)` with sigma2 = 2 Σx² / group over each group of
    `group` elements (the super-block). xb [32, n_sub, G] -> [32, n_sub, G]; importance as [32, n_sub, G]."""
    if importance is None:
        return xb * xb
    sum_x2 = seq_sum((xb * xb).permute(1, 0, 2).reshape(group, -1))  # element order within the group: [G]
    sigma2 = sum_x2 * float(np.float32(2.0) / np.float32(group))
    return importance * sqrt(sigma2 + xb * xb)


def _nibbles(index: torch.Tensor) -> torch.Tensor:
    """Level indices [32, B] -> qs [B, 16]: element j in the low nibble of byte j, j + 16 in the high one."""
    return (index[:16] | (index[16:] << 4)).t().to(torch.uint8)


def _layout(t: torch.Tensor, n_sub: int) -> torch.Tensor:
    """Rows [R, C] -> [32, n_sub, G]: element l of block j of group g (groups of n_sub * 32 elements)."""
    return t.reshape(-1, n_sub, 32).permute(2, 1, 0).contiguous()


def quantize_iq4_nl(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_iq4_nl: one 32-element block is its own super-block; d = the searched scale as float16."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=x.device)
    xb = _layout(x, 1)  # [32, 1, B]
    qw = None if importance is None else _layout(importance.expand(x.shape[0], -1), 1)
    weights = _weights(xb, qw, 32)
    xb, weights = xb.squeeze(1), weights.squeeze(1)
    d = _block_scales(xb, weights, levels)
    inv = torch.where(d != 0, div(1.0, d), 0.0)
    index = best_index(levels, inv * xb)
    return torch.cat([fp16_bytes(d), _nibbles(index)], dim=1).reshape(x.shape[0], -1)


def quantize_iq4_xs(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_iq4_xs: eight 32-element blocks share a float16 d and carry six-bit signed block scales."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=x.device)
    xb = _layout(x, 8)  # [32, 8, S]
    qw = None if importance is None else _layout(importance.expand(x.shape[0], -1), 8)
    weights = _weights(xb, qw, 256)
    scales = _block_scales(xb.reshape(32, -1), weights.reshape(32, -1), levels).reshape(8, -1)
    max_scale = signed_absmax(scales)  # the first scale of largest magnitude (zero blocks have scale 0)
    d = div(-max_scale, 32.0)  # [S]
    inv = torch.where(d != 0, div(1.0, d), 0.0)
    ls = nearest_int(inv * scales).clamp(-32, 31)  # [8, S]
    dl = d * ls.to(torch.float32)
    idl = torch.where(dl != 0, div(1.0, dl), 0.0)
    index = best_index(levels, idl * xb)  # [32, 8, S]
    ls = ls + 32
    scales_l = (ls[0::2] & 0xF) | ((ls[1::2] & 0xF) << 4)  # [4, S]
    shifts = 2 * torch.arange(8, device=x.device, dtype=torch.int32).reshape(8, 1)
    scales_h = ((ls >> 4) << shifts).sum(0)  # [S], a uint16
    scales_h = torch.stack([scales_h & 0xFF, scales_h >> 8], dim=1)
    qs = _nibbles(index.reshape(32, -1)).reshape(8, -1, 16).permute(1, 0, 2).reshape(-1, 128)
    fields = [fp16_bytes(d), scales_h.to(torch.uint8), scales_l.t().to(torch.uint8), qs]
    return torch.cat(fields, dim=1).reshape(x.shape[0], -1)
