"""`x @ weight.T` straight from GGUF blocks for the few rows of decode and verify passes (1..64), and the
choice of kernel per block type and row count.

Three kernel families read the blocks in place, never a dequantized copy of the matrix: the CUDA-core
product of `quant_gemv` (per input row, sub-block sums scaled once), its Q4_K tensor-core product (raw quants
times x per 32-value sub-block on MMA, scales applied to the [rows, BLOCK_N] result), and the tile kernel
below, which dequantizes a [BLOCK_N, 256] tile in registers exactly as `deltaspec.ops.quant.dequant` does
(float32, rounded to the activations' dtype) and multiplies it on tensor cores (rows padded to 16). Each
splits the input dimension SPLIT_K ways; with one split a program writes its output directly, with more the
float32 partial sums are added in a fixed order (`finish_kernel`), so results never depend on scheduling.
`LAUNCHES` (measured on an H200, `tools/quant_kernel_sweep.py`) says which family and tile each block type
takes at each row count. Supported here: Q8_0, Q4_K, Q6_K (what llama.cpp's Q4_K_M, Q6_K and Q8_0 files are
made of); other types, and products of more rows, dequantize the matrix and use cuBLAS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as dequantize_then_matmul
from deltaspec.ops.triton import quant_gemv

KERNEL_TYPES = {"Q8_0": 0, "Q4_K": 1, "Q6_K": 2}
# Triton's interpreter multiplies bfloat16 dot operands as their raw 16-bit storage: there, products are widened
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 64
STEP = 256


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian float16 stored at byte pointer(s) `ptr`, as float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile(w_ptr, w32_ptr, rows, row_bytes, step, n_mask, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_N, 256] of super-block `step` of weight rows `rows`, dequantized in float32. Bytes are read
    in contiguous runs (32-bit words where the layout is aligned) and unpacked with shifts and reshapes, never
    gathered value by value."""
    base = w_ptr + rows.to(tl.int64) * row_bytes  # [BLOCK_N]
    mask = n_mask[:, None]
    if QTYPE == 0:  # Q8_0: 8 blocks of (fp16 d, 32 x int8)
        block = base[:, None] + step * 272 + tl.arange(0, 8)[None, :] * 34  # [BLOCK_N, 8]
        d = _fp16_at(block, mask)
        quants = tl.load(block[:, :, None] + 2 + tl.arange(0, 32)[None, None, :], mask=mask[:, :, None], other=0)
        values = d[:, :, None] * quants.to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, 8, 32]
        return tl.reshape(values, (BLOCK_N, 256))
    elif QTYPE == 1:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        offset = rows.to(tl.int64) * row_bytes + step * 144  # [BLOCK_N] bytes
        block = w_ptr + offset
        d = _fp16_at(block[:, None], mask)  # [BLOCK_N, 1]
        dmin = _fp16_at(block[:, None] + 2, mask)
        j = tl.arange(0, 8)[None, :]  # sub-block of 32 values
        s_j = tl.load(block[:, None] + 4 + j, mask=mask, other=0).to(tl.int32)
        s_j4 = tl.load(block[:, None] + 8 + j, mask=mask, other=0).to(tl.int32)
        s_jm4 = tl.load(block[:, None] + 4 + tl.maximum(j - 4, 0), mask=mask, other=0).to(tl.int32)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))  # [BLOCK_N, 8]
        m = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        d1 = d * sc.to(tl.float32)
        m1 = dmin * m.to(tl.float32)
        # 32 words of 4 bytes: chunk c (4) of 8 words; byte k of word i holds values c*64 + i*4 + k (low nibble)
        # and c*64 + 32 + i*4 + k (high nibble)
        words = tl.load(
            w32_ptr + ((offset + 16) // 4)[:, None, None] + (tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :]),
            mask=mask[:, :, None],
            other=0,
        )  # [BLOCK_N, 4, 8]
        shifts = tl.arange(0, 2)[:, None] * 4 + tl.arange(0, 4)[None, :] * 8  # [hi, k]
        nibbles = (words[:, :, None, :, None] >> shifts[None, None, :, None, :]) & 0xF  # [BLOCK_N, 4, 2, 8, 4]
        quants = tl.reshape(nibbles, (BLOCK_N, 8, 32)).to(tl.float32)  # sub-block c*2 + hi, value i*4 + k
        return tl.reshape(d1[:, :, None] * quants - m1[:, :, None], (BLOCK_N, 256))
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, fp16 d
        block = base + step * 210
        d = _fp16_at(block + 208, n_mask)  # [BLOCK_N]
        lane = tl.arange(0, 32)
        low = tl.load(
            block[:, None, None, None]
            + (tl.arange(0, 2)[:, None, None] * 64 + tl.arange(0, 2)[None, :, None] * 32)
            + lane[None, None, :],
            mask=mask[:, :, None, None],
            other=0,
        ).to(tl.int32)  # [BLOCK_N, half, quarter % 2, 32]
        high = tl.load(
            block[:, None, None] + 128 + tl.arange(0, 2)[:, None] * 32 + lane[None, :], mask=mask[:, :, None], other=0
        ).to(tl.int32)  # [BLOCK_N, half, 32]
        low4 = (low[:, :, None, :, :] >> (tl.arange(0, 2) * 4)[None, None, :, None, None]) & 0xF  # [N, h, q//2, q%2, l]
        high2 = (high[:, :, None, :] >> (tl.arange(0, 4) * 2)[None, None, :, None]) & 3  # [N, h, q, l]
        quants = tl.reshape(low4, (BLOCK_N, 2, 4, 32)) | (high2 << 4)
        scales = tl.load(block[:, None] + 192 + tl.arange(0, 16)[None, :], mask=mask, other=0)
        scales = tl.reshape(scales.to(tl.int8, bitcast=True).to(tl.float32), (BLOCK_N, 2, 4, 2, 1))  # [N, h, q, l//16]
        dsc = d[:, None, None, None, None] * scales
        values = dsc * tl.reshape((quants - 32).to(tl.float32), (BLOCK_N, 2, 4, 2, 16))
        return tl.reshape(values, (BLOCK_N, 256))


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    w_ptr,
    w32_ptr,
    order_ptr,
    part_ptr,
    out_ptr,
    M,
    N,
    row_bytes,
    stride_xm,
    stride_om,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
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
        w = _tile(w_ptr, w32_ptr, rows, row_bytes, step, n_mask, QTYPE, BLOCK_N)  # [BLOCK_N, 256] fp32
        columns = step * 256 + k
        if HAS_ORDER:
            columns = tl.load(order_ptr + columns)
        x = tl.load(x_ptr + m[:, None] * stride_xm + columns[None, :], mask=m_mask[:, None], other=0.0)
        if IEEE:  # float32 products (no TF32 rounding): float32 activations, or Triton's interpreter
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = m_mask[:, None] & n_mask[None, :]
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + m[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + m[:, None] * N + rows[None, :], acc, mask=mask)


@dataclass(frozen=True)
class Launch:
    """How one segment's product runs: kernel family ("gemv", "dot" for Q4_K's sub-block MMA, "tile"), the
    weight rows per program, the split of the input dimension and the warps per program."""

    family: str
    block_n: int
    split_k: int
    num_warps: int = 4


# (block type, largest row count) -> launch; the first entry whose row count covers the product's is taken
LAUNCHES: dict[str, tuple[tuple[int, Launch], ...]] = {
    "Q4_K": ((1, Launch("gemv", 64, 4)), (MAX_ROWS, Launch("dot", 64, 4))),
    "Q6_K": ((1, Launch("gemv", 64, 4)), (MAX_ROWS, Launch("tile", 32, 4))),
    "Q8_0": ((1, Launch("gemv", 64, 4)), (MAX_ROWS, Launch("tile", 32, 4))),
}


def launch_for(qtype: str, rows: int) -> Launch:
    """The measured launch for `rows` input rows of a `qtype` segment."""
    return next(launch for most, launch in LAUNCHES[qtype] if rows <= most)


def _split(steps: int, wanted: int) -> int:
    """The largest split of `steps` super-blocks into at most `wanted` equal shares."""
    return max(s for s in range(1, min(wanted, steps) + 1) if steps % s == 0)


def _segment_matmul(
    x: torch.Tensor, order: torch.Tensor | None, qtype: str, data: torch.Tensor, out: torch.Tensor, launch: Launch
) -> None:
    """out [M, N] (a column slice of the product) = x [M, K] times one segment's rows [N, row_bytes]."""
    m, n = out.shape
    n_bytes = data.shape[1]
    steps = x.shape[1] // STEP
    split = _split(steps, launch.split_k)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    order = x if order is None else order
    common = {"HAS_ORDER": order is not x, "BLOCK_N": launch.block_n, "num_warps": launch.num_warps}
    tiles = triton.cdiv(n, launch.block_n)
    if launch.family == "gemv":
        args = (x, order)
        if qtype == "Q4_K":
            kernel, args, row_units = quant_gemv.q4_k_gemv_kernel, (*args, data.view(torch.int32)), n_bytes // 4
        elif qtype == "Q6_K":
            kernel, args, row_units = quant_gemv.q6_k_gemv_kernel, (*args, data, data.view(torch.int16)), n_bytes
        else:
            kernel, args, row_units = quant_gemv.q8_0_gemv_kernel, (*args, data.view(torch.int16)), n_bytes // 2
        kernel[(tiles, split, m)](*args, parts, out, n, row_units, x.stride(0), out.stride(0), steps // split, **common)
    else:
        block_m = max(16, triton.next_power_of_2(m))
        ieee = x.dtype == torch.float32 or INTERPRETED
        if launch.family == "dot":
            quant_gemv.q4_k_dot_kernel[(tiles, split)](
                x,
                order,
                data.view(torch.int32),
                parts,
                out,
                m,
                n,
                n_bytes // 4,
                x.stride(0),
                out.stride(0),
                steps // split,
                BLOCK_M=block_m,
                IEEE=ieee,
                **common,
            )
        else:
            words = data.view(torch.int32) if n_bytes % 4 == 0 else data  # Q4_K's nibbles are read as 32-bit words
            _quant_gemm_kernel[(tiles, split)](
                x,
                data,
                words,
                order,
                parts,
                out,
                m,
                n,
                n_bytes,
                x.stride(0),
                out.stride(0),
                steps // split,
                QTYPE=KERNEL_TYPES[qtype],
                BLOCK_M=block_m,
                IEEE=ieee,
                **common,
            )
    if split > 1:
        block = 1024
        quant_gemv.finish_kernel[(triton.cdiv(m * n, block),)](
            parts, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block
        )


def kernel_handles(weight: QuantizedWeight, rows: int, dtype: torch.dtype) -> bool:
    """Whether the block kernels run this product: few rows of 16- or 32-bit floats, a 2-D weight whose every
    segment is of a kernel type."""
    return (
        0 < rows <= MAX_ROWS
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and len(weight.shape) == 2
        and weight.in_features % STEP == 0
        and all(qtype in KERNEL_TYPES for qtype in weight.qtypes)
    )


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, launch: Launch | None = None) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) from the blocks for up to 64 rows, else dequantize + cuBLAS.
    `launch` overrides the table (for the sweep)."""
    rows = x.numel() // x.shape[-1]
    if not kernel_handles(weight, rows, x.dtype):
        return dequantize_then_matmul(x, weight)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(rows, weight.shape[0], device=x.device, dtype=x.dtype)
    column = 0
    for qtype, data in weight.segments:
        n = data.shape[0]
        _segment_matmul(
            flat, weight.input_order, qtype, data, out[:, column : column + n], launch or launch_for(qtype, rows)
        )
        column += n
    return out.view(*x.shape[:-1], weight.shape[0])
