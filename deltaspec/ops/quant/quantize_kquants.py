"""Quantizers of the k-quant types Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-element super-blocks), as ggml writes them.

Without importance these are ggml's `quantize_row_q*_K_ref` (which `quantize_q*_K` calls when quant_weights
is NULL); with importance they are `quantize_row_q*_K_impl`. Each function maps rows x [R, C] float32 (C a
multiple of 256) to blocks uint8 [R, C/256 * size]. Inside, S super-blocks of n-element sub-blocks are laid
out element-major, [n, n_sub, S], so the searches of `quantize_search` see [n, n_sub * S].
"""

import torch

from deltaspec.ops.quant.quantize_search import (
    GROUP_MAX_EPS,
    div,
    fp16_bytes,
    fp16_round,
    make_q3_quants,
    make_qkx_quants,
    make_qp_quants,
    make_qx_quants,
    nearest_int,
    seq_sum,
    signed_absmax,
    sqrt,
)

QK_K = 256


def _sub_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """Rows [R, C] -> sub-blocks element-major [n, 256/n, S]: element l of sub-block j of super-block s."""
    return x.reshape(-1, QK_K // n, n).permute(2, 1, 0).contiguous()


def _super_weights(x: torch.Tensor, importance: torch.Tensor, n: int, sigma_scale: float) -> torch.Tensor:
    """ggml's `qw[l] * sqrtf(sigma2 + x[l]*x[l])` with sigma2 = sigma_scale * Σx² / 256 per super-block.

    x [R, C], importance [C] -> weights [n, 256/n, S] in the layout of `_sub_blocks`.
    """
    xs = x.reshape(-1, QK_K)  # [S, 256]
    sum_x2 = seq_sum((xs * xs).t().contiguous())  # [S]
    sigma2 = div(sum_x2 * sigma_scale, float(QK_K))  # sigma_scale 1 or 2: exact
    w = importance.expand(x.shape[0], -1).reshape(-1, QK_K) * sqrt(sigma2.unsqueeze(1) + xs * xs)
    return w.reshape(-1, QK_K // n, n).permute(2, 1, 0).contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[n, n_sub, S] -> [n, n_sub * S] (the searches' [n, B])."""
    return t.reshape(t.shape[0], -1)


def _requantize(
    xs: torch.Tensor, levels: torch.Tensor, d: torch.Tensor, dm: torch.Tensor | None, lo: int, hi: int
) -> torch.Tensor:
    """ggml's final pass: l = clamp(nearest_int((x + dm) / d), lo, hi) per sub-block where d != 0, else keep.

    xs, levels [n, n_sub, S]; d, dm [n_sub, S]; dm None for the symmetric types (x / d).
    """
    v = xs if dm is None else xs + dm
    fresh = nearest_int(div(v, d)).clamp(lo, hi)
    return torch.where(d != 0, fresh, levels)


def _elements(levels: torch.Tensor) -> torch.Tensor:
    """Levels [n, n_sub, S] -> [S, 256] in element order."""
    return levels.permute(2, 1, 0).reshape(-1, QK_K)


def _two_bit(levels: torch.Tensor) -> torch.Tensor:
    """Levels 0..3 [S, 256] -> qs [S, 64]: element 128h + 32s + l at bits 2s of byte 32h + l."""
    parts = levels.reshape(-1, 2, 4, 32)
    packed = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return packed.reshape(-1, 64).to(torch.uint8)


def _k_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K six-bit scales and mins [8, S] (uint8 values as ggml holds them) -> the 12 scale bytes [S, 12].

    j < 4: byte j = ls, byte j+4 = lm; j >= 4: byte j+4 = low nibbles, top two bits into bits 6-7 of bytes
    j-4 (scale) and j (min). Written with ggml's assignments and |=, truncated to a byte.
    """
    ls = ls.t()
    lm = lm.t()
    low = torch.cat([ls[:, :4], lm[:, :4], (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], dim=1)
    high = torch.cat([(ls[:, 4:] >> 4) << 6, (lm[:, 4:] >> 4) << 6, torch.zeros_like(ls[:, :4])], dim=1)
    return ((low | high) & 0xFF).to(torch.uint8)


def _k_scale_values(ls: torch.Tensor, lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """get_scale_min_k4 of the bytes `_k_scales` writes: the six-bit scale and min of each sub-block [8, S]."""
    packed = _k_scales(ls, lm).to(torch.int32).t()  # [12, S]
    sc = torch.cat([packed[:4] & 63, (packed[8:] & 0xF) | ((packed[:4] >> 6) << 4)])
    m = torch.cat([packed[4:8] & 63, (packed[8:] >> 4) | ((packed[4:8] >> 6) << 4)])
    return sc, m


def _affine_k(
    x: torch.Tensor, importance: torch.Tensor | None, nmax: int, ref_search: tuple[float, float, int]
) -> tuple[torch.Tensor, ...]:
    """Shared body of Q4_K (nmax 15) and Q5_K (nmax 31): d, dmin [S] (float16-rounded), scale bytes
    [S, 12] and levels [32, 8, S]."""
    xs = _sub_blocks(x, 32)  # [32, 8, S]
    if importance is None:
        sum_x2 = seq_sum(xs * xs)  # [8, S]
        av_x = sqrt(div(sum_x2, 32.0))
        weights = av_x + xs.abs()
        scales, mins, levels = make_qkx_quants(_flat(xs), _flat(weights), nmax, *ref_search, False)
        scales, mins = scales.reshape(8, -1), mins.reshape(8, -1)
        max_scale = _running_max(scales)
        max_min = _running_max(mins)
        inv_scale = torch.where(max_scale > 0, div(63.0, max_scale), 0.0)
        inv_min = torch.where(max_min > 0, div(63.0, max_min), 0.0)
        ls = (nearest_int(inv_scale * scales) & 0xFF).clamp_max(63)
        lm = (nearest_int(inv_min * mins) & 0xFF).clamp_max(63)
        d = div(max_scale, 63.0)
        dmin = div(max_min, 63.0)
    else:
        weights = _super_weights(x, importance, 32, 2.0)
        sw = seq_sum(weights)  # [8, S]
        scales, mins, levels = make_qkx_quants(_flat(xs), _flat(weights), nmax, -0.9, 0.05, 36, False)
        d, ls = make_qp_quants(scales.reshape(8, -1), 63, sw)
        dmin, lm = make_qp_quants(mins.reshape(8, -1), 63, sw)
        if nmax == 31:  # quantize_row_q5_K_impl clamps with MIN(63, .); the Q4_K one does not
            ls, lm = ls.clamp_max(63), lm.clamp_max(63)
    levels = levels.reshape(32, 8, -1)
    d, dmin = fp16_round(d), fp16_round(dmin)
    sc, m = _k_scale_values(ls, lm)
    levels = _requantize(xs, levels, d * sc.to(torch.float32), dmin * m.to(torch.float32), 0, nmax)
    return d, dmin, _k_scales(ls, lm), levels


def _running_max(v: torch.Tensor) -> torch.Tensor:
    """ggml's `if (v > max) max = v` from max = +0 over dim 0 (never -0). [n, S] -> [S]."""
    top = v.amax(0)
    return torch.where(top > 0, top, 0.0)


def quantize_q4_k(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q4_K_ref, or quantize_row_q4_K_impl with importance."""
    d, dmin, scales, levels = _affine_k(x, importance, 15, (-1.0, 0.1, 20))
    flat = _elements(levels).reshape(-1, 4, 2, 32)
    qs = (flat[:, :, 0] | (flat[:, :, 1] << 4)).reshape(-1, 128).to(torch.uint8)
    return torch.cat([fp16_bytes(d), fp16_bytes(dmin), scales, qs], dim=1).reshape(x.shape[0], -1)


def quantize_q5_k(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q5_K_ref, or quantize_row_q5_K_impl with importance."""
    d, dmin, scales, levels = _affine_k(x, importance, 31, (-0.5, 0.1, 15))
    flat = _elements(levels).reshape(-1, 4, 2, 32)  # [S, pair, half, 32]
    qs = ((flat[:, :, 0] & 0xF) | ((flat[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    bits = ((flat >> 4) & 1).reshape(-1, 8, 32)  # [S, sub-block j, l]
    shifts = torch.arange(8, device=x.device, dtype=torch.int32).reshape(1, 8, 1)
    qh = (bits << shifts).sum(1)  # [S, 32]
    fields = [fp16_bytes(d), fp16_bytes(dmin), scales, qh.to(torch.uint8), qs.to(torch.uint8)]
    return torch.cat(fields, dim=1).reshape(x.shape[0], -1)


def quantize_q2_k(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q2_K_ref, or quantize_row_q2_K_impl with importance."""
    xs = _sub_blocks(x, 16)  # [16, 16, S]
    if importance is None:
        weights = xs.abs()
        scales, mins, levels = make_qkx_quants(_flat(xs), _flat(weights), 3, -0.5, 0.1, 15, True)
        scales, mins = scales.reshape(16, -1), mins.reshape(16, -1)
        max_scale = _running_max(scales)
        max_min = _running_max(mins)
        ls = torch.where(max_scale > 0, nearest_int(div(15.0, max_scale) * scales), 0)
        lm = torch.where(max_min > 0, nearest_int(div(15.0, max_min) * mins), 0)
        d = torch.where(max_scale > 0, div(max_scale, 15.0), 0.0)
        dmin = torch.where(max_min > 0, div(max_min, 15.0), 0.0)
    else:
        weights = _super_weights(x, importance, 16, 1.0)
        sw = seq_sum(weights)  # [16, S]
        scales, mins, levels = make_qkx_quants(_flat(xs), _flat(weights), 3, -0.9, 0.05, 36, False)
        d, ls = make_qp_quants(scales.reshape(16, -1), 15, sw)
        dmin, lm = make_qp_quants(mins.reshape(16, -1), 15, sw)
    scale_bytes = ((ls & 0xFF) | (lm << 4)) & 0xFF  # [16, S]
    d, dmin = fp16_round(d), fp16_round(dmin)
    sc = (scale_bytes & 0xF).to(torch.float32)
    m = (scale_bytes >> 4).to(torch.float32)
    levels = _requantize(xs, levels.reshape(16, 16, -1), d * sc, dmin * m, 0, 3)
    fields = [scale_bytes.t().to(torch.uint8), _two_bit(_elements(levels)), fp16_bytes(d), fp16_bytes(dmin)]
    return torch.cat(fields, dim=1).reshape(x.shape[0], -1)


def _q3_scale_bytes(ls: torch.Tensor) -> torch.Tensor:
    """Q3_K six-bit scales 0..63 [16, S] -> 12 bytes [S, 12]: low nibbles of j and j+8 in byte j < 8, the
    top two bits of j at bits 2*(j/4) of byte 8 + j%4."""
    ls = ls.t()  # [S, 16]
    low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    top = (ls >> 4).reshape(-1, 4, 4)  # [S, j/4, j%4]
    high = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    return torch.cat([low, high], dim=1).to(torch.uint8)


def quantize_q3_k(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q3_K_ref, or quantize_row_q3_K_impl with importance."""
    xs = _sub_blocks(x, 16)  # [16, 16, S]
    if importance is None:
        scales, levels = make_q3_quants(_flat(xs), 4)
        scales = scales.reshape(16, -1)
        max_scale = signed_absmax(scales)
        iscale = div(-32.0, max_scale)
        ls = torch.where(max_scale != 0, nearest_int(iscale * scales).clamp(-32, 31) + 32, 0)
        d = torch.where(max_scale != 0, div(1.0, iscale), 0.0)
    else:
        weights = _super_weights(x, importance, 16, 2.0)
        sw = seq_sum(weights)  # [16, S]
        scales, levels = make_qx_quants(_flat(xs), 4, _flat(weights))
        d, ls = make_qx_quants(scales.reshape(16, -1), 32, sw)
    d = fp16_round(d)
    sc = (ls - 32).to(torch.float32)
    levels = _requantize(xs, levels.reshape(16, 16, -1), d * sc, None, -4, 3)
    levels = torch.where((d * sc != 0).unsqueeze(0), levels + 4, levels)
    flat = _elements(levels)  # [S, 256], 0..7
    high = (flat > 3).reshape(-1, 8, 32).to(torch.int32)  # element 32b + m -> bit b of hmask[m]
    shifts = torch.arange(8, device=x.device, dtype=torch.int32).reshape(1, 8, 1)
    hmask = (high << shifts).sum(1)
    fields = [hmask.to(torch.uint8), _two_bit(flat & 3), _q3_scale_bytes(ls), fp16_bytes(d)]
    return torch.cat(fields, dim=1).reshape(x.shape[0], -1)


def quantize_q6_k(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q6_K_ref, or quantize_row_q6_K_impl with importance (which uses it as the weights)."""
    xs = _sub_blocks(x, 16)  # [16, 16, S]
    weights = None if importance is None else _flat(_sub_blocks(importance.expand(x.shape[0], -1), 16))
    scales, levels = make_qx_quants(_flat(xs), 32, weights)
    scales = scales.reshape(16, -1)
    max_scale = signed_absmax(scales)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = div(-128.0, max_scale)
    d = fp16_round(torch.where(zero, 0.0, div(1.0, iscale)))
    ls = nearest_int(iscale * scales).clamp_max(127)  # [16, S], -128..127
    dl = d * ls.to(torch.float32)
    levels = _requantize(xs, levels.reshape(16, 16, -1), dl, None, -32, 31)
    levels = torch.where((dl != 0).unsqueeze(0), levels + 32, levels)
    levels = torch.where(zero.reshape(1, 1, -1), 0, levels)
    ls = torch.where(zero, 0, ls)
    parts = _elements(levels).reshape(-1, 2, 4, 32)  # [S, half, s, l]
    ql = torch.stack(
        [
            (parts[:, :, 0] & 0xF) | ((parts[:, :, 2] & 0xF) << 4),
            (parts[:, :, 1] & 0xF) | ((parts[:, :, 3] & 0xF) << 4),
        ],
        dim=2,
    ).reshape(-1, 128)
    top = parts >> 4
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    fields = [ql.to(torch.uint8), qh.to(torch.uint8), (ls.t() & 0xFF).to(torch.uint8), fp16_bytes(d)]
    return torch.cat(fields, dim=1).reshape(x.shape[0], -1)
