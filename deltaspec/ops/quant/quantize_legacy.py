"""Quantizers of the 32-element block types Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, as ggml writes them.

Without importance these are ggml's `quantize_row_*_ref` (which `quantize_q*` calls when quant_weights is
NULL); with importance they are `quantize_row_q4_0_impl` & co. (Q8_0 has no importance path: ggml ignores
the imatrix). Each function maps rows x [R, C] float32 (C a multiple of 32) to blocks uint8 [R, C/32 * size].
"""

import torch

from deltaspec.ops.quant.quantize_search import (
    div,
    first_extreme,
    fp16_bytes,
    make_qkx_quants,
    make_qx_quants,
    seq_sum,
    signed_absmax,
    sqrt,
)

QK = 32


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Rows [R, C] -> blocks element-major [32, R * C/32] (block b = row-major block index)."""
    return x.reshape(-1, QK).t().contiguous()


def _rows(fields: list[torch.Tensor], n_rows: int) -> torch.Tensor:
    """Per-block byte fields, each uint8 [B, k], in struct order -> rows uint8 [R, B/R * size]."""
    return torch.cat(fields, dim=1).reshape(n_rows, -1)


def _nibbles(levels: torch.Tensor) -> torch.Tensor:
    """Levels int32 [32, B] -> qs uint8 [B, 16]: element j in the low nibble of byte j, j+16 in the high."""
    return ((levels[:16] & 0xF) | ((levels[16:] & 0xF) << 4)).t().to(torch.uint8)


def _high_bits(levels: torch.Tensor) -> torch.Tensor:
    """Levels int32 [32, B] -> qh uint8 [B, 4]: bit 4 of element j as bit j of a little-endian uint32."""
    bits = ((levels >> 4) & 1).reshape(4, 8, -1)  # [byte, bit, B]
    weights = (1 << torch.arange(8, device=levels.device, dtype=torch.int32)).reshape(1, 8, 1)
    return (bits * weights).sum(1).t().to(torch.uint8)


def _weights(x: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """ggml's `qw[j] * sqrtf(sigma2 + x[j]*x[j])` with sigma2 = Σx²/n over the whole row: x [R, C] -> [32, B]."""
    columns = x.shape[1]
    sigma2 = div(seq_sum((x * x).t().contiguous()), float(columns))  # [R]
    w = importance.unsqueeze(0) * sqrt(sigma2.unsqueeze(1) + x * x)
    return _blocks(w)


def quantize_q8_0(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q8_0_ref: d = amax/127, qs = roundf(x / d) (half away from zero)."""
    xb = _blocks(x)
    d = div(xb.abs().amax(0), 127.0)
    inv = torch.where(d != 0, div(1.0, d), 0.0)
    v = xb * inv
    q = torch.trunc(v)
    q = q + torch.where((v - q).abs() >= 0.5, torch.sign(v), 0.0)
    return _rows([fp16_bytes(d), q.to(torch.int8).t().contiguous().view(torch.uint8)], x.shape[0])


def _symmetric(x: torch.Tensor, importance: torch.Tensor | None, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (nmax 8) / Q5_0 (nmax 16): scale [B] and levels 0..2*nmax-1 int32 [32, B]."""
    xb = _blocks(x)
    if importance is not None:
        return make_qx_quants(xb, nmax, _weights(x, importance))
    d = div(signed_absmax(xb), float(-nmax))
    inv = torch.where(d != 0, div(1.0, d), 0.0)
    levels = torch.trunc(xb * inv + (nmax + 0.5)).to(torch.int32)
    return d, levels.clamp_max(2 * nmax - 1)


def _affine(x: torch.Tensor, importance: torch.Tensor | None, nmax: int) -> tuple[torch.Tensor, ...]:
    """Q4_1 (nmax 15) / Q5_1 (nmax 31): scale [B], offset m [B] and levels int32 [32, B]."""
    xb = _blocks(x)
    if importance is not None:
        scale, the_min, levels = make_qkx_quants(xb, _weights(x, importance), nmax, -0.9, 0.05, 36, False)
        return scale, -the_min, levels
    lo = first_extreme(xb, largest=False)
    hi = first_extreme(xb, largest=True)
    d = div(hi - lo, float(nmax))
    inv = torch.where(d != 0, div(1.0, d), 0.0)
    levels = torch.trunc((xb - lo) * inv + 0.5).to(torch.int32)
    # Q4_1 clamps with MIN(15, .); Q5_1 does not, but its levels never exceed 31.
    return d, lo, levels.clamp_max(nmax) if nmax == 15 else levels


def quantize_q4_0(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q4_0_ref, or quantize_row_q4_0_impl with importance."""
    d, levels = _symmetric(x, importance, 8)
    return _rows([fp16_bytes(d), _nibbles(levels)], x.shape[0])


def quantize_q5_0(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q5_0_ref, or quantize_row_q5_0_impl with importance."""
    d, levels = _symmetric(x, importance, 16)
    return _rows([fp16_bytes(d), _high_bits(levels), _nibbles(levels)], x.shape[0])


def quantize_q4_1(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q4_1_ref, or quantize_row_q4_1_impl with importance."""
    d, m, levels = _affine(x, importance, 15)
    return _rows([fp16_bytes(d), fp16_bytes(m), _nibbles(levels)], x.shape[0])


def quantize_q5_1(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q5_1_ref, or quantize_row_q5_1_impl with importance."""
    d, m, levels = _affine(x, importance, 31)
    return _rows([fp16_bytes(d), fp16_bytes(m), _high_bits(levels), _nibbles(levels)], x.shape[0])
