"""`x @ weight.T` straight from GGUF blocks for the few rows of decode and verify passes (1..64), and the
choice of kernel per block type and row count.

Two kernel families read the blocks in place, never a dequantized copy of the matrix: the CUDA-core
products of `quant_gemv` (a block of up to 16 input rows per program, each weight word decoded once for all of
them, sub-block sums scaled once) for decode and verify passes, and the tensor-core tile kernels below for more
rows, which dequantize a tile of weight rows in registers exactly as
`deltaspec.ops.quant.dequant` does (float32, rounded to the activations' dtype) and multiply it by x (rows
padded to 16): Q4_K one 64-value chunk at a time, the other types one 256-value super-block at a time. Each
splits the input dimension into shares; with one share a program writes its output directly, with more the
last program of an output tile to finish adds the float32 partial sums in a fixed order
(`quant_bits.store_or_add_shares`), so results never depend on scheduling.
`LAUNCHES` (measured on an H200, `tools/quant_kernel_sweep.py`) says which family and tile each block type
takes at each row count. Supported here: Q8_0, Q4_K, Q6_K (what llama.cpp's Q4_K_M, Q6_K and Q8_0 files are
made of), FP8_B128 (an FP8 checkpoint's weights) and I4_G32 and I4_G128 (a W4A16 checkpoint's int4 groups); other
types, and products of more rows, dequantize the matrix in one pass (`quant_dequant`) and use cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaspec.ops.quant import repacked
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as dequantize_then_matmul
from deltaspec.ops.triton import pdl, quant_bits, quant_dequant, quant_gemv, quant_gemv_hf, quant_mma, quant_mma_hf
from deltaspec.ops.triton.quant_bits import INTERPRETED  # there bfloat16 products are widened (IEEE)
from deltaspec.ops.triton.quant_dequant import KERNEL_TYPES, STEP, _q4_k_half_chunk, _tile

PRMT = not INTERPRETED  # the CUDA-core products' byte permutes as PTX (the interpreter takes shifts and masks)
HALF, BIASED = quant_bits.HALF_EXPONENT, quant_bits.BIASED_EXPONENT
MAX_ROWS = 64
I4_GROUPS = {"I4_G32": 32, "I4_G128": 128}  # int4 block type -> values per group
# the "mma" family of these types: tensor-core products of the blocks as loaded
MMA_HF = {"I4_G128": quant_mma_hf.i4_mma, "FP8_B128": quant_mma_hf.fp8_mma, "Q8_0": quant_mma_hf.q8_0_mma}


@triton.jit
def _tile_kernel(
    x_ptr,
    w_ptr,
    order_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    row_bytes,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Q8_0, Q6_K, FP8_B128 or int4 groups on tensor cores: each super-block's [BLOCK_N, 256] tile dequantized,
    then one product."""
    pdl.wait_for_previous()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k = tl.arange(0, 256)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        w = _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE, BLOCK_N)  # [BLOCK_N, 256] fp32
        acc += _times_x(x_ptr, order_ptr, m, m_mask, stride_xm, step * 256 + k, w, HAS_ORDER, IEEE)
    _store_tile(part_ptr, arrivals_ptr, out_ptr, acc, m, rows, m_mask, n_mask, M, N, stride_om)


@triton.jit
def _q4_k_tile_kernel(
    x_ptr,
    order_ptr,
    w32_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    row_words,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRED: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Q4_K on tensor cores, one 64-value chunk (two sub-blocks) at a time: the chunk's 8 nibble words per row
    are dequantized in registers and multiplied by x, either as one K = 64 product with the two sub-blocks'
    values interleaved (PAIRED; x is gathered in the same order) or as two K = 32 products."""
    pdl.wait_for_previous()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    row_start = rows.to(tl.int64) * row_words
    xm = tl.arange(0, BLOCK_M)
    m_mask = xm < M
    lane = tl.arange(0, 32)
    paired = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        block = row_start + step * 36
        head = tl.load(w32_ptr + block, mask=n_mask, other=0)
        s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
        s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
        s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
        d = quant_bits.half_bits(head)
        dmin = quant_bits.half_bits(head >> 16)
        for c in tl.static_range(4):
            quants = tl.load(
                w32_ptr + block[:, None] + 4 + c * 8 + tl.arange(0, 8)[None, :], mask=n_mask[:, None], other=0
            )  # [BLOCK_N, 8]
            low = _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, 2 * c, BLOCK_N)  # values c * 64 + l
            high = _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, 2 * c + 1, BLOCK_N)  # values c * 64 + 32 + l
            if PAIRED:
                w = tl.reshape(tl.join(low, high), (BLOCK_N, 64))  # column t is value c * 64 + (t % 2) * 32 + t // 2
                columns = step * 256 + c * 64 + (paired % 2) * 32 + paired // 2
                acc += _times_x(x_ptr, order_ptr, xm, m_mask, stride_xm, columns, w, HAS_ORDER, IEEE)
            else:
                columns = step * 256 + c * 64 + lane
                acc += _times_x(x_ptr, order_ptr, xm, m_mask, stride_xm, columns, low, HAS_ORDER, IEEE)
                acc += _times_x(x_ptr, order_ptr, xm, m_mask, stride_xm, columns + 32, high, HAS_ORDER, IEEE)
    _store_tile(part_ptr, arrivals_ptr, out_ptr, acc, xm, rows, m_mask, n_mask, M, N, stride_om)


@triton.jit
def _times_x(x_ptr, order_ptr, xm, m_mask, stride_xm, columns, w, HAS_ORDER: tl.constexpr, IEEE: tl.constexpr):
    """x[:, columns] [BLOCK_M, K] times w [BLOCK_N, K] transposed (float32 w, rounded to x's dtype first)."""
    if HAS_ORDER:
        columns = tl.load(order_ptr + columns)
    x = tl.load(x_ptr + xm[:, None] * stride_xm + columns[None, :], mask=m_mask[:, None], other=0.0)
    if IEEE:  # float32 products (no TF32 rounding): float32 activations, or Triton's interpreter
        return tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _store_tile(part_ptr, arrivals_ptr, out_ptr, acc, xm, rows, m_mask, n_mask, M, N, stride_om):
    """A program's [BLOCK_M, BLOCK_N] result (`quant_bits.store_or_add_shares`; its tile is grid(0))."""
    mask = m_mask[:, None] & n_mask[None, :]
    part_at = xm[:, None] * N + rows[None, :]
    out_at = xm[:, None] * stride_om + rows[None, :]
    quant_bits.store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, acc, part_at, out_at, mask, tl.program_id(0), M, N)


@dataclass(frozen=True)
class Launch:
    """How one segment's product runs: kernel family ("gemv" on CUDA cores, "tile" on tensor cores; "mma": the
    repacked layouts', I4_G128's, FP8_B128's and Q8_0's products of `quant_mma` and `quant_mma_hf`), weight
    rows per program, how many shares the input dimension is split into, warps per program, for Q4_K tiles
    whether a chunk's two sub-blocks make one K = 64 product, and for GEMVs the rows of x per program (a power of
    two; more rows take several row blocks, which share the weight's reads through L2)."""

    family: str
    block_n: int
    split_k: int
    num_warps: int = 4
    paired: bool = True
    m_block: int = 1
    num_stages: int = 2


# block type -> ((largest row count, launch), ...): the first entry whose row count covers the product's is taken.
# One row: graph-timed on an H200. The GEMV's blocks of rows: graph-timed on an H100 against one row
# (benchmarks/h100/c6d6957/quant-gemv-rows.json): 2 rows cost 1.23-1.79x one row there, where a tile costs what
# it costs at 16 rows (2.36x for Q4_K, 2.64x Q6_K, 4.8x I4_G128); past 2 rows the GEMV's per-row decoding makes
# it compute-bound (8 rows 4.3-6.5x), so only Q6_K's and int4's 4-row blocks, which beat the tiles, stay.
LAUNCHES: dict[str, tuple[tuple[int, Launch], ...]] = {
    "Q4_K": (
        (1, Launch("gemv", 64, 8, 2)),
        (2, Launch("gemv", 64, 8, 2, m_block=2)),
        (16, Launch("tile", 128, 4)),
        (MAX_ROWS, Launch("tile", 32, 4, paired=False)),
    ),
    "Q6_K": (
        (1, Launch("gemv", 32, 8, 2)),
        (2, Launch("gemv", 32, 8, 2, m_block=2)),
        (4, Launch("gemv", 32, 8, 4, m_block=4)),
        (MAX_ROWS, Launch("tile", 32, 4)),
    ),
    "Q8_0": ((1, Launch("gemv", 32, 8)), (2, Launch("gemv", 32, 8, 4, m_block=2)), (MAX_ROWS, Launch("tile", 32, 4))),
    # FP8: the one-row launch graph-timed on an H200 over the 27B shape's four products (weights past L2)
    "FP8_B128": (
        (1, Launch("gemv", 32, 4)),
        (2, Launch("gemv", 32, 4, 4, m_block=2)),
        (MAX_ROWS, Launch("tile", 32, 4)),
    ),
    # int4: one row and the tiles graph-timed on an H200 at 1 and 16 rows (the 27B shapes, weights past L2); the
    # row blocks on an H100 for I4_G128, I4_G32 taking the same kernel
    "I4_G32": (
        (1, Launch("gemv", 32, 4, 2)),
        (2, Launch("gemv", 32, 4, 2, m_block=2)),
        (4, Launch("gemv", 32, 4, 4, m_block=4)),
        (MAX_ROWS, Launch("tile", 32, 4)),
    ),
    # the repacked layouts (`quant_mma`; "gemv" on CUDA cores, "mma" on tensor cores), graph-timed on an H100 over
    # the 27B shape's gate_up and down products (benchmarks/h100/15b48f7/quant-mma-sweep-quick.json)
    "Q4_K_R": ((1, Launch("gemv", 128, 8, 4)), (MAX_ROWS, Launch("mma", 128, 8, 4))),
    "Q6_K_R": ((MAX_ROWS, Launch("mma", 64, 8, 4)),),
    "I4_G128": (
        (1, Launch("gemv", 64, 8)),
        (2, Launch("gemv", 64, 8, 8, m_block=2)),
        (4, Launch("gemv", 64, 8, 8, m_block=4)),
        (MAX_ROWS, Launch("tile", 64, 2)),
    ),
}


def launch_for(qtype: str, rows: int) -> Launch:
    """The measured launch for `rows` input rows of a `qtype` segment."""
    return next(launch for most, launch in LAUNCHES[qtype] if rows <= most)


def _segment_matmul(
    x: torch.Tensor, order: torch.Tensor | None, qtype: str, data: torch.Tensor, out: torch.Tensor, launch: Launch
) -> None:
    """out [M, N] (a column slice of the product) = x [M, K] times one segment's rows [N, row_bytes]."""
    if qtype in MMA_HF and launch.family == "mma":  # the blocks as loaded, on tensor cores (`quant_mma_hf`)
        x = x if order is None else x.index_select(1, order)
        options = {"block_n": launch.block_n, "split_k": launch.split_k, "num_warps": launch.num_warps}
        MMA_HF[qtype](x, data, out, num_stages=launch.num_stages, **options)
        return
    if qtype in repacked.BASE:
        x = x if order is None else x.index_select(1, order)  # the stored columns' order
        options = {"block_n": launch.block_n, "split_k": launch.split_k, "num_warps": launch.num_warps}
        planes = repacked.planes(data, qtype, x.shape[1])
        if launch.family == "gemv":
            quant_mma.gemv(x, planes, out, qtype, num_stages=launch.num_stages, **options)
        else:
            quant_mma.mma(x, planes, out, qtype, num_stages=launch.num_stages, **options)
        return
    m, n = out.shape
    n_bytes = data.shape[1]
    steps = x.shape[1] // STEP
    per_share = triton.cdiv(steps, launch.split_k)
    shares = triton.cdiv(steps, per_share)
    parts = torch.empty(shares, m, n, device=x.device, dtype=torch.float32) if shares > 1 else out
    gathered = order is not None
    order = x if order is None else order
    row_blocks = triton.cdiv(m, launch.m_block) if launch.family == "gemv" else 1
    grid = (triton.cdiv(n, launch.block_n) * row_blocks, shares)  # a GEMV's row blocks side by side (quant_gemv)
    arrivals = quant_bits.arrival_counts(x.device, triton.next_power_of_2(grid[0]))
    results = (parts, arrivals, out, m, n)  # where the kernels put their sums, and the output's shape
    tail = (x.stride(0), out.stride(0), steps, per_share)
    common = {"HAS_ORDER": gathered, "BLOCK_N": launch.block_n, "num_warps": launch.num_warps, **pdl.LAUNCH}
    if launch.family == "gemv":
        common["M_BLOCK"] = launch.m_block
        if qtype == "Q4_K":
            quant_gemv.q4_k_gemv_kernel[grid](
                x, order, data.view(torch.int32), *results, n_bytes // 4, *tail, HALF, PRMT=PRMT, **common
            )
        elif qtype == "Q6_K":
            quant_gemv.q6_k_gemv_kernel[grid](
                x, order, data, data.view(torch.int16), *results, n_bytes, *tail, HALF, PRMT=PRMT, **common
            )
        elif qtype == "FP8_B128":
            quant_gemv_hf.fp8_b128_gemv_kernel[grid](x, order, data, *results, n_bytes, *tail, **common)
        elif qtype in I4_GROUPS:
            quant_gemv_hf.i4_gemv_kernel[grid](
                x,
                order,
                data.view(torch.int32),
                *results,
                n_bytes // 4,
                *tail,
                HALF,
                GROUP=I4_GROUPS[qtype],
                PRMT=PRMT,
                **common,
            )
        else:
            quant_gemv.q8_0_gemv_kernel[grid](
                x, order, data.view(torch.int16), *results, n_bytes // 2, *tail, BIASED, PRMT=PRMT, **common
            )
    else:
        tile = {"BLOCK_M": max(16, triton.next_power_of_2(m)), "IEEE": x.dtype == torch.float32 or INTERPRETED}
        if qtype == "Q4_K":
            _q4_k_tile_kernel[grid](
                x, order, data.view(torch.int32), *results, n_bytes // 4, *tail, PAIRED=launch.paired, **tile, **common
            )
        else:
            _tile_kernel[grid](x, data, order, *results, n_bytes, *tail, QTYPE=KERNEL_TYPES[qtype], **tile, **common)


def kernel_handles(weight: QuantizedWeight, rows: int, dtype: torch.dtype) -> bool:
    """Whether the block kernels run this product: few rows of 16- or 32-bit floats, a 2-D weight whose every
    segment is of a kernel type."""
    return (
        0 < rows <= MAX_ROWS
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and len(weight.shape) == 2
        and weight.in_features % STEP == 0
        and all(qtype in KERNEL_TYPES or qtype in repacked.BASE for qtype in weight.qtypes)
    )


def _dequantize_then_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """More rows than the block kernels take, or other block types: each segment dequantized in one pass
    (`quant_dequant`), then one cuBLAS product; stacked experts and float64 take the reference."""
    if len(weight.shape) != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return dequantize_then_matmul(x, weight)
    dense = torch.empty(weight.shape, device=x.device, dtype=x.dtype)  # [out, in]
    row = 0
    for qtype, data in weight.segments:
        rows = dense[row : row + data.shape[0]]
        if qtype in repacked.BASE:
            quant_mma.dequantize(data, qtype, weight.in_features, x.dtype, out=rows)
        else:
            quant_dequant.dequantize(data, qtype, x.dtype, out=rows)
        row += data.shape[0]
    return F.linear(weight.ordered_input(x), dense)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, launch: Launch | None = None) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) from the blocks for up to 64 rows, else dequantize + cuBLAS.
    `launch` overrides the table (tests and the sweep)."""
    rows = x.numel() // x.shape[-1]
    if not kernel_handles(weight, rows, x.dtype):
        return _dequantize_then_matmul(x, weight)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(rows, weight.shape[0], device=x.device, dtype=x.dtype)
    column = 0
    for qtype, data in weight.segments:
        n = data.shape[0]
        segment_out = out[:, column : column + n]
        _segment_matmul(flat, weight.input_order, qtype, data, segment_out, launch or launch_for(qtype, rows))
        column += n
    return out.view(*x.shape[:-1], weight.shape[0])
