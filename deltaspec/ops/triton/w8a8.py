"""The CUDA path of `--fp8-activations dynamic` (`deltaspec.ops.quant.w8a8`, the spec): FP8 segments of products
of more than 64 rows on Hopper's FP8 tensor cores.

Per product: one Triton kernel quantizes the activations (per token and 128 features, amax / 448, divisions
correctly rounded as torch's, so values and scales are the reference's bytes), one splits each FP8_B128 segment's
132-byte blocks into its e4m3 values [rows, in] and float32 block scales [rows, in / 128] (1 byte a weight value
written, half what the W8A16 path's dequantization writes), and cuBLAS multiplies them with block scaling
(`torch.nn.functional.scaled_mm`, 1 x 128 scales on both sides, [rows, in / 128] stored row-fastest: a block's
scale is its row's, as FP8_B128 keeps it, so fused and sharded weights whose rows do not start on 128-row tiles
multiply alike). Products of up to 64 rows, and devices without that product (before Hopper, torch before 2.10) go
the reference's way: `quant_matmul.quantized_linear`, and the reference's W8A8 arithmetic respectively.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaspec.ops.quant import w8a8 as reference
from deltaspec.ops.quant.fp8 import BLOCK, BLOCK_BYTES, QTYPE
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton import pdl, quant_dequant, quant_matmul

RUNS = 8  # 128-value runs per program of both kernels
ROW_ALIGN = 16  # cuBLAS's FP8 products take output widths (a segment's rows) in multiples of 16
SCALE_ROWS = 4  # and activation scales [in / 128, rows] of whole 16-byte columns: 65 rows were refused, 100 not


@triton.jit
def _e4m3_byte(v):
    """float32 v (|v| <= 448) -> its e4m3 byte, rounded to nearest even as torch's cast (integer ops: the
    interpreter's float8 cast rounds otherwise)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)  # to 3 mantissa bits, ties to even
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent rebiased from 127 to 7
    subnormal = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # multiples of 2**-9, ties to even
    return (sign | tl.where(magnitude >= 0x3C800000, normal, subnormal)).to(tl.uint8)  # 0x3C800000: 2**-6


@triton.jit
def _quantize_kernel(x_ptr, values_ptr, scales_ptr, scale_stride, runs_per_row, stride_xm, RUNS: tl.constexpr):
    """Row m's runs r0 .. r0 + RUNS of 128 values -> their e4m3 values and scales (written at [run, m])."""
    pdl.wait_for_previous()
    m = tl.program_id(0)
    run = tl.program_id(1) * RUNS + tl.arange(0, RUNS)  # [RUNS]
    column = run[:, None] * 128 + tl.arange(0, 128)[None, :]  # [RUNS, 128]
    mask = run[:, None] < runs_per_row
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + column, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)  # [RUNS]
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    tl.store(values_ptr + m.to(tl.int64) * runs_per_row * 128 + column, _e4m3_byte(scaled), mask=mask)
    tl.store(scales_ptr + run.to(tl.int64) * scale_stride + m, scale, mask=run < runs_per_row)


@triton.jit
def _split_kernel(words_ptr, values_ptr, scales_ptr, rows, runs_per_row, RUNS: tl.constexpr):
    """Row r's blocks b0 .. b0 + RUNS (33 words each: the scale, then 32 words of values) -> its value words
    [rows, runs * 32] and scales (written at [run, r])."""
    pdl.wait_for_previous()
    row = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1) * RUNS + tl.arange(0, RUNS)  # [RUNS]
    mask = run < runs_per_row
    block = words_ptr + row * runs_per_row * 33 + run * 33  # [RUNS] pointers to the blocks' scale words
    word = tl.arange(0, 32)[None, :]
    values = tl.load(block[:, None] + 1 + word, mask=mask[:, None])
    tl.store(values_ptr + row * runs_per_row * 32 + run[:, None] * 32 + word, values, mask=mask[:, None])
    tl.store(scales_ptr + run.to(tl.int64) * rows + row, tl.load(block, mask=mask), mask=mask)


def quantize_activations(x: torch.Tensor, rows_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_activations` of x [M, K] (rows contiguous): (values [P, K] e4m3, scales [P, K / 128]
    float32 stored token-fastest, the layout cuBLAS reads), P the rows rounded up to `rows_multiple`, the rows
    after M zeros with scale 1."""
    m, k = x.shape
    runs = k // BLOCK
    padded = -(-m // rows_multiple) * rows_multiple
    values = torch.empty(padded, k, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(runs, padded, device=x.device, dtype=torch.float32)  # [K/128, P]
    if padded > m:
        values[m:].view(torch.uint8).zero_()
        scales[:, m:] = 1.0
    if m:
        grid = (m, triton.cdiv(runs, RUNS))
        _quantize_kernel[grid](x, values.view(torch.uint8), scales, padded, runs, x.stride(0), RUNS=RUNS, **pdl.LAUNCH)
    return values, scales.t()


def split_blocks(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP8_B128 segment's blocks [rows, in / 128 * 132] -> (values [rows, in] e4m3, scales [rows, in / 128]
    float32 stored row-fastest, the layout cuBLAS reads), the reference being `data.view(rows, -1, 132)` split
    after its 4 scale bytes."""
    rows, row_bytes = data.shape
    runs = row_bytes // BLOCK_BYTES
    values = torch.empty(rows, runs * BLOCK, device=data.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(runs, rows, device=data.device, dtype=torch.float32)  # [in/128, rows]
    if rows:
        grid = (rows, triton.cdiv(runs, RUNS))
        words = (data.view(torch.int32), values.view(torch.int32), scales.view(torch.int32))
        _split_kernel[grid](*words, rows, runs, RUNS=RUNS, **pdl.LAUNCH)
    return values, scales.t()


def tensor_cores(x: torch.Tensor) -> bool:
    """Whether cuBLAS's block-scaled FP8 product is there for activations like `x` (16-bit floats on a Hopper
    GPU, torch with `scaled_mm`)."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and hasattr(F, "scaled_mm")
        and torch.cuda.get_device_capability(x.device)[0] == 9
    )


def fp8_dynamic_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`reference.fp8_dynamic_linear` on CUDA: [..., in] -> [..., out]."""
    rows = x.numel() // x.shape[-1]
    if not reference.takes_dynamic(weight, rows):
        return quant_matmul.quantized_linear(x, weight)
    if not tensor_cores(x):
        return reference.fp8_dynamic_linear(x, weight)
    flat = weight.ordered_input(x).reshape(rows, x.shape[-1]).contiguous()
    values, scales = quantize_activations(flat, SCALE_ROWS)
    parts = []
    for qtype, data in weight.segments:
        if qtype == QTYPE and data.shape[0] % ROW_ALIGN == 0:
            w_values, w_scales = split_blocks(data)
            product = F.scaled_mm(
                values,
                w_values.t(),
                scales,
                F.ScalingType.BlockWise1x128,
                w_scales,
                F.ScalingType.BlockWise1x128,
                output_dtype=x.dtype,
            )[:rows]
        elif qtype == QTYPE:  # a width cuBLAS does not take: the reference's arithmetic
            activations = reference.dequantize_activations(values[:rows], scales[:rows], torch.float32)
            product = F.linear(activations, quant_dequant.dequantize(data, qtype, torch.float32)).to(x.dtype)
        else:
            product = F.linear(flat, quant_dequant.dequantize(data, qtype, x.dtype))
        parts.append(product)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out.view(*x.shape[:-1], weight.shape[0])
