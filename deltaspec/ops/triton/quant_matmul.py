"""`x @ weight.T` straight from GGUF blocks, for the few rows of decode and verify passes (1..64).

One program owns BLOCK_N output rows (weight rows) and a 1 / SPLIT_K share of the input dimension; it walks
its share 256 values at a time (one k-quant super-block, or eight Q8_0 blocks), dequantizes that
[BLOCK_N, 256] tile in registers exactly as `deltaspec.ops.quant.dequant` does (float32, rounded to the
activations' dtype) and multiplies it by the rows of x on tensor cores (rows padded to 16). The weight's
bytes are read once; split-K partial sums go to a float32 workspace [SPLIT_K, M, N] that is summed in a
fixed order, so results do not depend on scheduling. Supported here: Q8_0, Q4_K, Q6_K (what llama.cpp's
Q4_K_M, Q6_K and Q8_0 files are made of); other types, and products of more rows, dequantize the matrix
and use cuBLAS (`quantized_linear`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as dequantize_then_matmul

KERNEL_TYPES = {"Q8_0": 0, "Q4_K": 1, "Q6_K": 2}
# Triton's interpreter multiplies bfloat16 dot operands as their raw 16-bit storage: there, products are widened
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SUPER_BYTES = {"Q8_0": 8 * 34, "Q4_K": 144, "Q6_K": 210}  # bytes per 256 values
MAX_ROWS = 64
STEP = 256


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian float16 stored at byte pointer(s) `ptr`, as float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE: tl.constexpr):
    """Values [BLOCK_N, 256] of super-block `step` of weight rows `rows`, dequantized in float32."""
    v = tl.arange(0, 256)
    base = w_ptr + rows[:, None].to(tl.int64) * row_bytes  # [BLOCK_N, 1]
    mask = n_mask[:, None]
    if QTYPE == 0:  # Q8_0: 8 blocks of (fp16 d, 32 x int8)
        block = base + step * 272 + (v // 32)[None, :] * 34
        d = _fp16_at(block, mask)
        q = tl.load(block + 2 + (v % 32)[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        return d * q.to(tl.float32)
    elif QTYPE == 1:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        block = base + step * 144
        d = _fp16_at(block, mask)
        dmin = _fp16_at(block + 2, mask)
        chunk = v // 64
        within = v % 64
        j = (chunk * 2 + within // 32)[None, :]  # sub-block of 32 values
        s_j = tl.load(block + 4 + j, mask=mask, other=0).to(tl.int32)
        s_j4 = tl.load(block + 8 + j, mask=mask, other=0).to(tl.int32)
        s_jm4 = tl.load(block + 4 + tl.maximum(j - 4, 0), mask=mask, other=0).to(tl.int32)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))
        m = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        byte = tl.load(block + 16 + (chunk * 32 + within % 32)[None, :], mask=mask, other=0).to(tl.int32)
        q = (byte >> ((within // 32) * 4)[None, :]) & 0xF
        d1 = d * sc.to(tl.float32)
        m1 = dmin * m.to(tl.float32)
        return d1 * q.to(tl.float32) - m1
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, fp16 d
        block = base + step * 210
        d = _fp16_at(block + 208, mask)
        half = v // 128
        r = v % 128
        quarter = r // 32
        lane = r % 32
        low_at = half * 64 + lane + (quarter % 2) * 32
        low = tl.load(block + low_at[None, :], mask=mask, other=0).to(tl.int32)
        high = tl.load(block + 128 + (half * 32 + lane)[None, :], mask=mask, other=0).to(tl.int32)
        q = ((low >> ((quarter // 2) * 4)[None, :]) & 0xF) | (((high >> (2 * quarter)[None, :]) & 3) << 4)
        scale_at = half * 8 + lane // 16 + 2 * quarter
        sc = tl.load(block + 192 + scale_at[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        return (d * sc.to(tl.float32)) * (q - 32).to(tl.float32)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    M,
    N,
    row_bytes,
    stride_xm,
    steps_per_split,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k = tl.arange(0, 256)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(steps_per_split):
        step = split * steps_per_split + i
        w = _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE)  # [BLOCK_N, 256] fp32
        x = tl.load(x_ptr + m[:, None] * stride_xm + (step * 256 + k)[None, :], mask=m_mask[:, None], other=0.0)
        if IEEE:  # float32 products (no TF32 rounding): float32 activations, or Triton's interpreter
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = part_ptr + split * M * N + m[:, None] * N + rows[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def _segment_matmul(x: torch.Tensor, qtype: str, data: torch.Tensor, block_n: int, split_k: int) -> torch.Tensor:
    """x [M, K] times one segment's rows [N, row_bytes] of `qtype` -> float32 [M, N]."""
    rows, row_bytes = data.shape
    steps = x.shape[1] // STEP
    split = split_k if steps % split_k == 0 else 1
    parts = torch.empty(split, x.shape[0], rows, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(rows, block_n), split)
    _quant_gemm_kernel[grid](
        x,
        data,
        parts,
        x.shape[0],
        rows,
        row_bytes,
        x.stride(0),
        steps // split,
        QTYPE=KERNEL_TYPES[qtype],
        BLOCK_M=max(16, triton.next_power_of_2(x.shape[0])),
        BLOCK_N=block_n,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
    )
    return parts.sum(0) if split > 1 else parts[0]


def kernel_handles(weight: QuantizedWeight, rows: int, dtype: torch.dtype) -> bool:
    """Whether the block kernel runs this product: few rows of 16- or 32-bit floats, a 2-D weight whose every
    segment is of a kernel type."""
    return (
        0 < rows <= MAX_ROWS
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and len(weight.shape) == 2
        and weight.in_features % STEP == 0
        and all(qtype in KERNEL_TYPES for qtype in weight.qtypes)
    )


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, block_n: int = 32, split_k: int = 4) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) from the blocks for up to 64 rows, else dequantize + cuBLAS."""
    rows = x.numel() // x.shape[-1]
    if not kernel_handles(weight, rows, x.dtype):
        return dequantize_then_matmul(x, weight)
    flat = weight.ordered_input(x.reshape(rows, x.shape[-1])).contiguous()
    outs = [_segment_matmul(flat, qtype, data, block_n, split_k) for qtype, data in weight.segments]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
