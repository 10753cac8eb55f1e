"""Reference dequantization of ggml's codebook i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S),
its ternary types (TQ1_0, TQ2_0) and Q1_0, as llama.cpp's `dequantize_row_*` (ggml/src/ggml-quants.c) computes
them, for `deltaspec.ops.quant.dequant`.

An i-quant block of 256 values holds a float16 scale `d` (IQ1_M: spread over the top nibbles of its sub-block
scales), a small scale per 32 (or 16) values, and per group of 8 (IQ2, IQ1) or 4 (IQ3) values an index into a
fixed codebook of value patterns (`iq_grids.npz`, written from ggml-common.h by tools/make_iq_grids.py). IQ2 and
IQ3 keep the magnitudes there and one sign bit per value apart: IQ2_S and IQ3_S as plain bytes, IQ2_XXS, IQ2_XS
and IQ3_XXS as 7-bit indices whose 8th sign makes the number of minus signs even (`_signs`). IQ1 patterns are
values in {-1, 0, 1}, shifted by ±1/8 per group. Every product is exact in float32 (a float16 scale, a scale of at
most 5 bits, a codebook value of at most 6), so any order of the multiplications gives ggml's bits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

GRIDS = Path(__file__).with_name("iq_grids.npz")
IQ1_DELTA = 0.125  # ggml's IQ1S_DELTA and IQ1M_DELTA


@functools.cache
def _grid_on(name: str, device: torch.device) -> torch.Tensor:
    with np.load(GRIDS) as grids:
        return torch.from_numpy(grids[name].astype(np.float32)).to(device)  # [entries, 8 or 4]


def _grid(name: str, index: torch.Tensor) -> torch.Tensor:
    """Codebook `name`'s patterns at `index` [...] -> float32 [..., 8 or 4]."""
    return _grid_on(name, index.device)[index.long()]


def _half(field: torch.Tensor) -> torch.Tensor:
    return field.contiguous().view(torch.float16).to(torch.float32)  # [n, 2] bytes -> [n, 1]


def _words(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned words of `width` bytes: [..., k * width] uint8 -> [..., k] int64."""
    b = raw.reshape(*raw.shape[:-1], -1, width).to(torch.int64)
    return sum(b[..., i] << (8 * i) for i in range(width))


def _bits(byte: torch.Tensor, count: int = 8) -> torch.Tensor:
    """Bits 0..count-1 of each integer: [...] -> [..., count] int64 (0 or 1)."""
    return (byte.to(torch.int64).unsqueeze(-1) >> torch.arange(count, device=byte.device)) & 1


def _signs(index: torch.Tensor) -> torch.Tensor:
    """ggml's ksigns_iq2xs: a 7-bit sign index -> the signs (+1 / -1) of 8 values [..., 8], the 8th bit set when
    the index has an odd number of bits."""
    bits = _bits(index, 7)
    bits = torch.cat([bits, bits.sum(-1, keepdim=True) & 1], dim=-1)
    return 1.0 - 2.0 * bits.to(torch.float32)


def _sign_bytes(byte: torch.Tensor) -> torch.Tensor:
    return 1.0 - 2.0 * _bits(byte).to(torch.float32)  # [..., 8]


def _quarter_scales(d: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S: `d * (0.5 + s) * 0.25` for each 16 values' nibble (low, then high, of each scale byte)."""
    nibbles = torch.stack([scales & 0xF, scales >> 4], dim=-1).reshape(scales.shape[0], -1)  # [n, 16]
    return d * (0.5 + nibbles.to(torch.float32)) * 0.25


def iq2_xxs(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    groups = f["qs"].reshape(n, 8, 8)  # per 32 values: 4 codebook indices, then a word of 4 x 7 sign bits + scale
    word = _words(groups[..., 4:], 4)[..., 0]  # [n, 8]
    scale = _half(f["d"]) * (0.5 + (word >> 28).to(torch.float32)) * 0.25  # [n, 8]
    signs = _signs((word.unsqueeze(-1) >> (7 * torch.arange(4, device=word.device))) & 127)  # [n, 8, 4, 8]
    values = _grid("iq2xxs", groups[..., :4]) * signs  # [n, 8, 4, 8]
    return (scale[..., None, None] * values).reshape(n, 256)


def iq2_xs(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    q = _words(f["qs"], 2).reshape(n, 16, 2)  # per 8 values: 9-bit index, 7-bit signs; two groups per scale
    values = _grid("iq2xs", q & 511) * _signs(q >> 9)  # [n, 16, 2, 8]
    scale = _quarter_scales(_half(f["d"]), f["scales"].to(torch.int64))  # [n, 16]
    return (scale[..., None, None] * values).reshape(n, 256)


def iq2_s(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    low, sign_bytes = f["qs"][:, :32].to(torch.int64), f["qs"][:, 32:]  # [n, 32] each: per 8 values
    high = (f["qh"].to(torch.int64).unsqueeze(-1) >> (2 * torch.arange(4, device=low.device))) & 3  # [n, 8, 4]
    index = low | (high.reshape(n, 32) << 8)  # 10-bit indices
    values = (_grid("iq2s", index) * _sign_bytes(sign_bytes)).reshape(n, 16, 2, 8)
    scale = _quarter_scales(_half(f["d"]), f["scales"].to(torch.int64))  # [n, 16]
    return (scale[..., None, None] * values).reshape(n, 256)


def iq3_xxs(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    index = f["qs"][:, :64].reshape(n, 8, 4, 2)  # per 32 values, per 8: two indices of 4 values
    word = _words(f["qs"][:, 64:], 4)  # [n, 8]: 4 x 7 sign bits, then the scale in the top 4 bits
    scale = _half(f["d"]) * (0.5 + (word >> 28).to(torch.float32)) * 0.5  # [n, 8]
    signs = _signs((word.unsqueeze(-1) >> (7 * torch.arange(4, device=word.device))) & 127)  # [n, 8, 4, 8]
    values = _grid("iq3xxs", index).reshape(n, 8, 4, 8) * signs
    return (scale[..., None, None] * values).reshape(n, 256)


def iq3_s(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    high = _bits(f["qh"]).reshape(n, 64)  # bit k of qh[b]: the 9th index bit of sub-block b's index k
    index = f["qs"].to(torch.int64) | (high << 8)  # [n, 64], 4 values each
    values = _grid("iq3s", index).reshape(n, 32, 8) * _sign_bytes(f["signs"])  # [n, 32, 8]
    scales = f["scales"].to(torch.int64)
    nibbles = torch.stack([scales & 0xF, scales >> 4], dim=-1).reshape(n, 8)  # sub-block b: nibble b % 2 of b // 2
    scale = _half(f["d"]) * (1 + 2 * nibbles).to(torch.float32)  # [n, 8]
    return (scale[..., None, None] * values.reshape(n, 8, 4, 8)).reshape(n, 256)


def _iq1(index: torch.Tensor, negative_delta: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """IQ1 values `scale * (pattern + delta)`: index [n, 32], negative_delta [n, 32] (0 / 1), scale [n, 32]."""
    delta = IQ1_DELTA * (1.0 - 2.0 * negative_delta.to(torch.float32))
    return (scale.unsqueeze(-1) * (_grid("iq1s", index) + delta.unsqueeze(-1))).reshape(index.shape[0], 256)


def iq1_s(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    qh = _words(f["qh"], 2)  # [n, 8]: per 32 values 4 x 3 index bits, a 3-bit scale, the delta's sign
    high = (qh.unsqueeze(-1) >> (3 * torch.arange(4, device=qh.device))) & 7  # [n, 8, 4]
    index = f["qs"].to(torch.int64).reshape(n, 8, 4) | (high << 8)
    scale = _half(f["d"]) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)  # [n, 8]
    negative = ((qh >> 15) & 1).unsqueeze(-1).expand(n, 8, 4)
    return _iq1(index.reshape(n, 32), negative.reshape(n, 32), scale.repeat_interleave(4, dim=1))


def iq1_m(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    sc = _words(f["scales"], 2)  # [n, 4]: per 64 values 4 x 3 scale bits; the top nibbles make d's float16
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d_bits = torch.where(d_bits >= 1 << 15, d_bits - (1 << 16), d_bits)  # as int16, without relying on wrap-around
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32).unsqueeze(-1)  # [n, 1]
    scale_bits = (sc.unsqueeze(-1) >> (3 * torch.arange(4, device=sc.device))) & 7  # [n, 4, 4]: per 16 values
    scale = d * (2 * scale_bits.reshape(n, 16) + 1).to(torch.float32)  # [n, 16]
    qh = f["qh"].to(torch.int64)  # [n, 16]: per 8 values a nibble, 3 index bits and the delta's sign
    nibble = torch.stack([qh & 0xF, qh >> 4], dim=-1).reshape(n, 32)
    index = f["qs"].to(torch.int64) | ((nibble & 7) << 8)
    return _iq1(index, nibble >> 3, scale.repeat_interleave(2, dim=1))


def _ternary(trits: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (trits - 1).to(torch.float32) * d


def tq1_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Five trits per byte of `qs` (three-valued digits of the byte as a fraction of 256: digit k is
    `((q * 3**k) mod 256) * 3 >> 8`), four per byte of `qh`; value i of a byte group is digit i // width."""
    n = f["qs"].shape[0]

    def digits(packed: torch.Tensor, count: int) -> torch.Tensor:  # [n, w] -> [n, count * w], digit-major
        powers = torch.tensor([1, 3, 9, 27, 81][:count], dtype=torch.int64, device=packed.device)
        q = (packed.to(torch.int64).unsqueeze(1) * powers.unsqueeze(-1)) & 255  # [n, count, w]
        return ((q * 3) >> 8).reshape(n, -1)

    qs = f["qs"]
    trits = torch.cat([digits(qs[:, :32], 5), digits(qs[:, 32:], 5), digits(f["qh"], 4)], dim=1)  # [n, 256]
    return _ternary(trits, _half(f["d"]))


def tq2_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Two bits per value: value 128h + 32j + l is bits 2j..2j+1 of qs[32h + l], minus 1."""
    n = f["qs"].shape[0]
    q = f["qs"].to(torch.int64).reshape(n, 2, 1, 32) >> (2 * torch.arange(4, device=f["qs"].device)).view(1, 1, 4, 1)
    return _ternary((q & 3).reshape(n, 256), _half(f["d"]))


def q1_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """One bit per value (bit j % 8 of byte j // 8): +d when set, else -d."""
    n = f["qs"].shape[0]
    return (2.0 * _bits(f["qs"]).reshape(n, 128).to(torch.float32) - 1.0) * _half(f["d"])


DEQUANTIZERS = {
    "IQ2_XXS": iq2_xxs,
    "IQ2_XS": iq2_xs,
    "IQ2_S": iq2_s,
    "IQ3_XXS": iq3_xxs,
    "IQ3_S": iq3_s,
    "IQ1_S": iq1_s,
    "IQ1_M": iq1_m,
    "TQ1_0": tq1_0,
    "TQ2_0": tq2_0,
    "Q1_0": q1_0,
}
