"""ggml's scale searches (ggml/src/ggml-quants.c), vectorised over blocks: the shared core of the quantizers.

Owns the float32 arithmetic that makes `deltaspec.ops.quant.quantize` byte-identical to ggml: `nearest_int`,
`make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`/`make_qkx3_quants` (one function: they differ only in
their defaults, which no caller uses), `make_qp_quants` and IQ4_NL's `best_index_int8`.

Layout: a batch of B blocks of n elements is [n, B] (element i of block b at [i, b]), so a per-block value is
[B] and a running sum over a block is a loop over contiguous rows. ggml adds each sum left to right in float32
and rounds every product separately (ggml-base is compiled without FMA contraction on x86-64): `seq_sum` and
the operation order written out below reproduce that bit for bit. Loops run over the few elements of a block
and over the fixed candidate grids of a search, never over blocks.

Torch pitfalls avoided on purpose: `torch.sqrt` of float32 is not correctly rounded on the CPU (see `sqrt`);
`number / tensor` is `tensor.reciprocal() * number`, and CUDA divides by a CPU scalar by multiplying with its
reciprocal, so every division here goes through `div`, tensor by tensor. Float constants that ggml computes in
float32 (`nmax + 0.1f*is`) are computed in numpy float32.
"""

import numpy as np
import torch

GROUP_MAX_EPS = float(np.float32(1e-15))


def div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b, one correctly rounded float32 division (either side may be a number)."""
    ref = a if isinstance(a, torch.Tensor) else b
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=torch.float32, device=ref.device)
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=torch.float32, device=ref.device)
    return torch.div(a, b)


def sqrt(v: torch.Tensor) -> torch.Tensor:
    """sqrtf, correctly rounded: torch's float32 sqrt on AVX-512 CPUs is not (it misses ~15% of roundings),
    while a float64 square root rounded to float32 always is. Same shape."""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: round half to even through the 1.5 * 2^23 trick. float32 -> int32, same shape."""
    return ((v + 12582912.0).view(torch.int32) & 0x7FFFFF) - 0x400000


def fp16_round(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)): round to nearest even float16 and widen back."""
    return v.to(torch.float16).to(torch.float32)


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [B] -> its float16 (round to nearest even) as little-endian bytes uint8 [B, 2]."""
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def seq_sum(t: torch.Tensor, from_zero: bool = True) -> torch.Tensor:
    """Σ over dim 0, added left to right in float32 as ggml's loops do. [n, ...] -> [...].

    `from_zero` starts from 0 (`float s = 0; s += t[i]`); otherwise from t[0] (`float s = t[0]; ...`),
    which differs only in the sign of an all-zero sum.
    """
    acc = torch.zeros_like(t[0]) + t[0] if from_zero else t[0]
    for row in t[1:]:
        acc = acc + row
    return acc


def first_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """The value at the first index of x's max (or min) over dim 0, as ggml's `if (v > max)` loops keep it
    (only the sign of a zero can differ from amax/amin). [n, B] -> [B]."""
    index = x.argmax(0) if largest else x.argmin(0)
    return x.gather(0, index.unsqueeze(0)).squeeze(0)


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """ggml's `if (ax > amax) { amax = ax; max = x[i]; }` from amax = 0: the first element of largest
    magnitude, signed; +0 when the block is all zeros. [n, B] -> [B]."""
    value = x.gather(0, x.abs().argmax(0).unsqueeze(0)).squeeze(0)
    return torch.where(value != 0, value, torch.zeros_like(value))


def make_qx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1: symmetric levels -nmax..nmax-1 for blocks x [n, B].

    Weights are `weights` (the importance path) or x² (quant_weights NULL). Returns the scale [B] and the
    levels L = l + nmax, int32 [n, B]; a block below GROUP_MAX_EPS gets scale 0 and L = 0.
    """
    w = x * x if weights is None else weights
    wx = w * x
    xmax = signed_absmax(x)

    def trial(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        level = nearest_int(iscale * x).clamp(-nmax, nmax - 1)  # [n, B]
        lf = level.to(torch.float32)
        sumlx, suml2 = seq_sum(torch.stack([wx * lf, w * lf * lf], dim=1)).unbind(0)
        return level + nmax, sumlx, suml2

    levels, sumlx, suml2 = trial(div(float(-nmax), xmax))
    scale = torch.where(suml2 != 0, div(sumlx, suml2), 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        numerator = -np.float32(np.float32(nmax) + np.float32(0.1) * np.float32(step))
        cand, sumlx, suml2 = trial(div(float(numerator), xmax))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better, cand, levels)
        scale = torch.where(better, div(sumlx, suml2), scale)
        best = torch.where(better, scale * sumlx, best)
    zero = xmax.abs() < GROUP_MAX_EPS
    return torch.where(zero, 0.0, scale), torch.where(zero, 0, levels)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with do_rmse: levels -nmax..nmax-1 refined one element at a time (x² weights).

    Returns the scale [B] and L = l + nmax, int32 [n, B]; an all-zero block gets scale 0 and L = 0.
    """
    xmax = signed_absmax(x)
    w = x * x
    wx = w * x
    levels = nearest_int(div(float(-nmax), xmax) * x).clamp(-nmax, nmax - 1)
    lf = levels.to(torch.float32)
    sumlx, suml2 = seq_sum(torch.stack([wx * lf, w * lf * lf], dim=1)).unbind(0)
    rows = list(levels.unbind(0))
    # ggml stops after a pass that changes nothing; such a pass leaves the state as it was, so five
    # unconditional passes give the same result.
    for _ in range(5):
        for i in range(x.shape[0]):
            old = rows[i].to(torch.float32)
            slx = sumlx - wx[i] * old
            sl2 = suml2 - w[i] * old * old
            new = nearest_int(div(x[i] * sl2, slx)).clamp(-nmax, nmax - 1)
            newf = new.to(torch.float32)
            slx_new = slx + wx[i] * newf
            sl2_new = sl2 + w[i] * newf * newf
            take = (slx > 0) & (new != rows[i]) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            rows[i] = torch.where(take, new, rows[i])
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
    scale = torch.where(suml2 > 0, div(sumlx, suml2), 0.0)
    zero = xmax.abs() < GROUP_MAX_EPS
    return torch.where(zero, 0.0, scale), torch.where(zero, 0, torch.stack(rows) + nmax)


def make_qkx_quants(
    x: torch.Tensor,
    weights: torch.Tensor,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants (with weights): levels 0..nmax with an offset, for x [n, B].

    Tries iscale = (rmin + rdelta*is + nmax) / (max - min) for is = 0..nstep, fits scale and min by weighted
    least squares, keeps the smallest weighted error (|diff| if use_mad, else diff²). As in ggml, `min` is the
    best fit so far, so later candidates are placed relative to it. Returns the scale [B],
    `the_min` [B] (minus the offset, >= 0) and the levels int32 [n, B].
    """
    xmin = first_extreme(x, largest=False)
    xmin = torch.where(xmin > 0, 0.0, xmin)
    xmax = x.amax(0)
    sum_w = seq_sum(weights, from_zero=False)
    sum_x = seq_sum(weights * x, from_zero=False)

    def error(scale: torch.Tensor, offset: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = scale * levels.to(torch.float32) + offset - x
        return seq_sum(weights * (diff.abs() if use_mad else diff * diff))

    iscale = div(float(nmax), xmax - xmin)
    scale = div(1.0, iscale)
    levels = nearest_int(iscale * (x - xmin)).clamp(0, nmax)
    best = error(scale, xmin, levels)
    offset = xmin
    for step in range(nstep + 1):
        numerator = np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax)
        cand = nearest_int(div(float(numerator), xmax - offset) * (x - offset)).clamp(0, nmax)
        lf = cand.to(torch.float32)
        wl = weights * lf
        sum_l, sum_l2, sum_xl = seq_sum(torch.stack([wl, wl * lf, wl * x], dim=1)).unbind(0)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = div(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = div(sum_l2 * sum_x - sum_l * sum_xl, det)
        clipped = this_min > 0
        this_scale = torch.where(clipped, div(sum_xl, sum_l2), this_scale)
        this_min = torch.where(clipped, 0.0, this_min)
        cur = error(this_scale, this_min, cand)
        better = (det > 0) & (cur < best)
        levels = torch.where(better, cand, levels)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        offset = torch.where(better, this_min, offset)
    flat = xmax == xmin
    return torch.where(flat, 0.0, scale), -torch.where(flat, xmin, offset), torch.where(flat, 0, levels)


def make_qp_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants: quantize non-negative sub-block scales x [n, B] to 0..nmax under `weights`.

    Returns the super-block scale [B] and the levels int32 [n, B] as ggml stores them (uint8).
    """
    xmax = x.amax(0).clamp_min(0.0)

    def levels_at(iscale: torch.Tensor) -> torch.Tensor:
        return nearest_int(iscale * x).clamp_max(nmax)

    def mse(scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = x - scale * levels.to(torch.float32)
        return seq_sum(weights * diff * diff)

    iscale = div(float(nmax), xmax)
    best = mse(div(1.0, iscale), nearest_int(iscale * x))
    for step in range(-4, 5):
        if step == 0:
            continue
        cand = div(float(np.float32(np.float32(0.1) * np.float32(step)) + np.float32(nmax)), xmax)
        err = mse(div(1.0, cand), levels_at(cand))
        better = err < best
        best = torch.where(better, err, best)
        iscale = torch.where(better, cand, iscale)
    levels = levels_at(iscale)
    lf = levels.to(torch.float32)
    wx = weights * x
    sumlx, suml2 = seq_sum(torch.stack([wx * lf, weights * lf * lf], dim=1)).unbind(0)
    rows = list((levels & 0xFF).unbind(0))  # ggml keeps L as uint8
    for _ in range(5):  # passes after one that changes nothing change nothing (see make_q3_quants)
        for i in range(x.shape[0]):
            old = rows[i].to(torch.float32)
            slx = sumlx - wx[i] * old
            sl2 = suml2 - weights[i] * old * old
            new = nearest_int(div(x[i] * sl2, slx)).clamp_max(nmax)
            newf = new.to(torch.float32)
            slx_new = slx + wx[i] * newf
            sl2_new = sl2 + weights[i] * newf * newf
            take = (slx > 0) & (sl2 > 0) & (new != rows[i]) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            rows[i] = torch.where(take, new & 0xFF, rows[i])
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
    scale = torch.where(suml2 > 0, div(sumlx, suml2), 0.0)
    zero = xmax < GROUP_MAX_EPS
    return torch.where(zero, 0.0, scale), torch.where(zero, 0, torch.stack(rows))


def best_index(levels: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8: the index of the nearest of the sorted `levels` (float32 [k]) to each of v,
    the lower one on a tie only if strictly nearer. float32 [...] -> int64 [...]."""
    k = levels.shape[0]
    upper = torch.bucketize(v, levels, right=True).clamp(1, k - 1)  # first level > v
    lower_value = levels[upper - 1]
    upper_value = levels[upper]
    index = torch.where(v - lower_value < upper_value - v, upper - 1, upper)
    index = torch.where(v <= levels[0], 0, index)
    return torch.where(v >= levels[k - 1], k - 1, index)
