"""Reference dequantization of GGUF tensors: the contract deltaspec's quantized kernels must meet.

`dequantize` turns packed blocks into float32 bit for bit as llama.cpp's `dequantize_row_*`
(ggml/src/ggml-quants.c) computes them, in ggml's order: `(d * scale) * q`, then the offset
where the type has one (`+ m`, or `- dmin * min`). Every product there is exact in float32 (a float16 scale carries 11
significant bits, sub-block scale and quant together at most 12 more, and MXFP4's scale is a power
of two), so the one rounding is the final add of Q4_1, Q5_1, Q2_K, Q4_K and Q5_K: a kernel gets the
same bits in any order, with or without fused multiply-adds, as long as it computes in float32.

Pure torch, vectorised over all blocks, on whatever device its input lives (so also the CUDA
fallback). A row holds whole blocks, so embedding rows need no helper: `dequantize(blocks[rows], qtype)`.
"""

from collections.abc import Callable

import torch

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant import dequant_iq, repacked
from deltaspec.ops.quant.formats import QK_K, QuantFormat, format_of

# ggml's kvalues_iq4nl: the 16 non-linear levels of IQ4_NL and IQ4_XS.
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's kvalues_mxfp4: E2M1 values doubled (the E8M0 scale is halved to match).
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Packed uint8 blocks [..., n_blocks * type_size] of GGUF type `qtype` -> float32 [..., n_blocks * block_size].
    A repacked matrix (`Q4_K_R`, `Q6_K_R`: [rows, row_bytes], whole) is unpacked to its blocks first."""
    fmt = format_of(qtype)
    if qtype in repacked.BASE:
        blocks = repacked.unpack(blocks, qtype, blocks.shape[-1] // fmt.type_size * QK_K)
        qtype = repacked.BASE[qtype]
        fmt = format_of(qtype)
    if blocks.dtype != torch.uint8:
        raise DeltaspecError(f"{qtype} blocks must be a uint8 tensor of raw bytes, not {blocks.dtype}.")
    n_bytes = blocks.shape[-1] if blocks.dim() > 0 else 0
    if blocks.dim() == 0 or n_bytes % fmt.type_size != 0:
        raise DeltaspecError(
            f"A {qtype} row must be a whole number of {fmt.type_size}-byte blocks, not {n_bytes} bytes."
        )
    n_blocks = n_bytes // fmt.type_size
    flat = blocks.reshape(-1, fmt.type_size)  # [total_blocks, type_size]
    values = _DEQUANTIZERS[fmt.name](_fields(flat, fmt))  # [total_blocks, block_size]
    return values.reshape(*blocks.shape[:-1], n_blocks * fmt.block_size)


def _fields(flat: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Split blocks [total_blocks, type_size] into their struct fields, each [total_blocks, field_bytes]."""
    names = [name for name, _ in fmt.fields]
    return dict(zip(names, torch.split(flat, [n_bytes for _, n_bytes in fmt.fields], dim=1)))


def _half(field: torch.Tensor) -> torch.Tensor:
    """A float16 field [n, 2] (little-endian bytes) -> float32 [n, 1], widened exactly."""
    return field.contiguous().view(torch.float16).to(torch.float32)


def _bit_fields(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Unsigned `width`-bit fields of each byte, lowest first: [..., k] uint8 -> [..., count, k] int32."""
    shifts = torch.arange(0, width * count, width, dtype=torch.int32, device=packed.device)  # [count]
    return (packed.to(torch.int32).unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << width) - 1)


def _little_endian_bits(packed: torch.Tensor) -> torch.Tensor:
    """The bits of a little-endian bitmask, bit i at position i: [n, k] uint8 -> [n, 8 * k] int32."""
    return _bit_fields(packed, 1, 8).transpose(-1, -2).reshape(packed.shape[0], -1)


def _levels(table: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.float32, device=device)  # [16]


def _float32(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["value"].contiguous().view(torch.float32)  # [n, 1]


def _float16(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _half(f["value"])  # [n, 1]


def _bfloat16(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["value"].contiguous().view(torch.bfloat16).to(torch.float32)  # [n, 1]


def _q8_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["qs"].view(torch.int8).to(torch.float32) * _half(f["d"])  # [n, 32]


def _q4_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    q = _bit_fields(f["qs"], 4, 2).reshape(n, 32) - 8  # low nibbles are elements 0-15, high 16-31
    return q.to(torch.float32) * _half(f["d"])


def _q4_1(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    q = _bit_fields(f["qs"], 4, 2).reshape(n, 32)
    return q.to(torch.float32) * _half(f["d"]) + _half(f["m"])


def _five_bit(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Q5_0/Q5_1 quants 0..31: a nibble from `qs` plus bit i of the 32-bit mask `qh` as bit 4 of element i."""
    n = f["qs"].shape[0]
    return _bit_fields(f["qs"], 4, 2).reshape(n, 32) | (_little_endian_bits(f["qh"]) << 4)  # [n, 32]


def _q5_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return (_five_bit(f) - 16).to(torch.float32) * _half(f["d"])


def _q5_1(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _five_bit(f).to(torch.float32) * _half(f["d"]) + _half(f["m"])


def _two_bit_k(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K low quants: element 128*h + 32*j + l is bits 2j..2j+1 of qs[32*h + l]. [n, 64] -> [n, 256]."""
    n = qs.shape[0]
    return _bit_fields(qs.reshape(n, 2, 32), 2, 4).reshape(n, 256)


def _q2_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    scales = f["scales"].to(torch.int32)  # [n, 16], one per 16 elements: scale low nibble, min high
    d_scale = _half(f["d"]) * (scales & 0xF).to(torch.float32)  # [n, 16]
    d_min = _half(f["dmin"]) * (scales >> 4).to(torch.float32)  # [n, 16]
    q = _two_bit_k(f["qs"]).reshape(n, 16, 16).to(torch.float32)
    return (d_scale.unsqueeze(-1) * q - d_min.unsqueeze(-1)).reshape(n, 256)


def _q3_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    packed = f["scales"]  # [n, 12]: 16 six-bit scales, low nibbles in bytes 0-7, top 2 bits in 8-11
    low = _bit_fields(packed[:, :8], 4, 2).reshape(n, 16)  # scale i: nibble i // 8 of byte i % 8
    high = _bit_fields(packed[:, 8:], 2, 4).reshape(n, 16)  # scale i: bits 2*(i // 4) of byte 8 + i % 4
    d_scale = _half(f["d"]) * ((low | (high << 4)) - 32).to(torch.float32)  # [n, 16]
    # element e subtracts 4 unless bit e // 32 of hmask[e % 32] is set
    high_bit = _bit_fields(f["hmask"], 1, 8).reshape(n, 256)
    q = (_two_bit_k(f["qs"]) - 4 * (1 - high_bit)).reshape(n, 16, 16).to(torch.float32)
    return (d_scale.unsqueeze(-1) * q).reshape(n, 256)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: [n, 12] uint8 -> six-bit scales and mins [n, 8] int32."""
    b = packed.to(torch.int32)
    scale = torch.cat([b[:, 0:4] & 63, (b[:, 8:12] & 0xF) | ((b[:, 0:4] >> 6) << 4)], dim=1)
    minimum = torch.cat([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], dim=1)
    return scale, minimum


def _k_affine(f: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: `(d * scale) * q - (dmin * min)` per 32-element sub-block; q [n, 8, 32] int32 -> [n, 256]."""
    scale, minimum = _k_scale_min(f["scales"])
    d_scale = _half(f["d"]) * scale.to(torch.float32)  # [n, 8]
    d_min = _half(f["dmin"]) * minimum.to(torch.float32)  # [n, 8]
    return (d_scale.unsqueeze(-1) * q.to(torch.float32) - d_min.unsqueeze(-1)).reshape(q.shape[0], 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Sub-block 2c takes the low nibbles of qs[32c:32c+32], sub-block 2c+1 the high: [n, 128] -> [n, 8, 32]."""
    n = qs.shape[0]
    return _bit_fields(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)


def _q4_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _k_affine(f, _k_nibbles(f["qs"]))


def _q5_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    high_bit = _bit_fields(f["qh"], 1, 8)  # [n, 8, 32]: sub-block s takes bit s of qh[l]
    return _k_affine(f, _k_nibbles(f["qs"]) | (high_bit << 4))


def _q6_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["ql"].shape[0]
    # Each 128-element half h: group g (32 elements) takes nibble g // 2 of ql[64h + 32 * (g % 2) + l]
    # and bits 2g..2g+1 of qh[32h + l] as bits 4-5.
    low = _bit_fields(f["ql"].reshape(n, 2, 2, 32), 4, 2).transpose(2, 3).reshape(n, 2, 4, 32)
    high = _bit_fields(f["qh"].reshape(n, 2, 32), 2, 4)  # [n, 2, 4, 32]
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16).to(torch.float32)
    d_scale = _half(f["d"]) * f["scales"].view(torch.int8).to(torch.float32)  # [n, 16]
    return (d_scale.unsqueeze(-1) * q).reshape(n, 256)


def _iq4_nl(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    index = _bit_fields(f["qs"], 4, 2).reshape(n, 32)
    return _half(f["d"]) * _levels(IQ4_NL_LEVELS, index.device)[index]


def _iq4_xs(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    low = _bit_fields(f["scales_l"], 4, 2).transpose(1, 2).reshape(n, 8)  # sub-block i: nibble i % 2 of byte i // 2
    high = _bit_fields(f["scales_h"], 2, 4).transpose(1, 2).reshape(n, 8)  # bits 2i..2i+1 of the uint16
    d_scale = _half(f["d"]) * ((low | (high << 4)) - 32).to(torch.float32)  # [n, 8]
    index = _bit_fields(f["qs"].reshape(n, 8, 16), 4, 2).reshape(n, 8, 32)
    return (d_scale.unsqueeze(-1) * _levels(IQ4_NL_LEVELS, index.device)[index]).reshape(n, 256)


def _mxfp4(f: dict[str, torch.Tensor]) -> torch.Tensor:
    n = f["qs"].shape[0]
    e = f["e"].to(torch.int32)  # [n, 1]
    # ggml_e8m0_to_fp32_half: 2^(e - 128), the two smallest as float32 subnormals
    scale = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    index = _bit_fields(f["qs"], 4, 2).reshape(n, 32)
    return _levels(MXFP4_LEVELS, index.device)[index] * scale


def _fp8_b128(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """e4m3 values times their tile's float32 scale, rounded once in float32 (as transformers dequantizes)."""
    values = f["qs"].contiguous().view(torch.float8_e4m3fn).to(torch.float32)  # [n, 128], exact
    return values * f["scale"].contiguous().view(torch.float32)


def _int4_groups(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """s * (q' - z') for one group's bfloat16 or float16 scale s, zero point z' and nibbles q' (exact in float32)."""
    bits = f["scale"].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    as_bfloat16 = (bits << 16).view(torch.float32)
    as_float16 = bits.to(torch.int16).view(torch.float16).to(torch.float32)
    scale = torch.where(f["scale_type"] == 0, as_bfloat16, as_float16)
    n = f["qs"].shape[0]
    q = _bit_fields(f["qs"], 4, 2).transpose(1, 2).reshape(n, -1)  # [n, G]: value 2i low, 2i + 1 high nibble
    return scale * (q - f["zero"].to(torch.int32)).to(torch.float32)


_DEQUANTIZERS: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "F32": _float32,
    "F16": _float16,
    "BF16": _bfloat16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
    "FP8_B128": _fp8_b128,
    "I4_G32": _int4_groups,
    "I4_G128": _int4_groups,
    **dequant_iq.DEQUANTIZERS,
}
