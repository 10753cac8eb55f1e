"""Q4_K and Q6_K products of 1 to 64 rows from the planes of their repacked layouts
(`deltaspec.ops.quant.repacked`): on tensor cores (`mma`) and, for a row or two, on CUDA cores (`gemv`), and
the one-pass dequantization of prefill-sized products (`dequantize`).

A program owns BLOCK_N output rows and a share of the super-blocks. Per super-block a Q4_K program reads the 32
nibble words of each row in one load (lane l of all eight sub-blocks). On tensor cores the quants q themselves are
the operand, as the exact 16-bit floats 0.5 + q / 256 and 0.5 + q / 16 (a byte's low and high nibble; one permute
per two words and one masked or per sub-block and pair), and a sub-block's scale and min act on its float32 sums;
on CUDA cores each byte becomes the float f = 0.5 + q / 32 with one permute (`quant_bits.byte_as_float`), so that a
value is one multiply-add, (32 * scale) * f - (16 * scale + min), within a float32 rounding of the reference's
(`deltaspec.ops.quant.dequant`). Q6_K dequantizes as the reference does, its values rounded to the activations'
dtype for the tensor cores. Shares of the input are added in a fixed order (`quant_bits.store_or_add_shares`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops.quant import repacked
from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.quant_bits import INTERPRETED
from deltaspec.ops.triton.quant_dequant import _q4_k_sub_block

DEQUANT_BLOCK_N = 64


@triton.jit
def _q4_k_head(heads_ptr, step, cols, n_mask, N):
    """d, dmin (float32) and the three words of 6-bit scales and mins of super-block `step` of rows `cols`."""
    head = heads_ptr + step * 4 * N + cols
    h0 = tl.load(head, mask=n_mask, other=0)
    s0 = tl.load(head + N, mask=n_mask, other=0)
    s1 = tl.load(head + 2 * N, mask=n_mask, other=0)
    s2 = tl.load(head + 3 * N, mask=n_mask, other=0)
    return quant_bits.half_bits(h0), quant_bits.half_bits(h0 >> 16), s0, s1, s2


@triton.jit
def _q4_k_lanes(words_ptr, step, cols, n_mask, N):
    """The 32 nibble words [32, BLOCK_N] of super-block `step` of rows `cols`, and their quants moved into the top
    bits of bytes: byte b of `low` is sub-block 2b's quant q << 3 at lane l (the row), of `high` sub-block 2b + 1's."""
    words = tl.load(
        words_ptr + (step * 32 + tl.arange(0, 32))[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0
    )
    return (words << 3) & 0x78787878, (words >> 1) & 0x78787878


@triton.jit
def _q4_k_sub_block_values(low, high, j: tl.constexpr, half_exponent, PRMT: tl.constexpr):
    """Sub-block j's quants [32, BLOCK_N] as the floats f = 0.5 + q / 32 (one permute each)."""
    if j % 2 == 0:
        return quant_bits.byte_as_float(low, j // 2, half_exponent, PRMT)
    return quant_bits.byte_as_float(high, j // 2, half_exponent, PRMT)


def _nibble_values_asm(b: int, half: bool) -> tl.constexpr:
    """`nibble_values`' PTX for byte b: t's bytes 0 and 2 are byte b of the two words; then the low nibbles under
    the exponent of 0.5 in $0, the high ones in $1 (bfloat16: 0x3F00 | q and 0x3F00 | q << 4; float16, whose
    mantissa has ten bits: t shifted left by three, 0x3800 | q << 3 and 0x3800 | q << 7)."""
    select = f"prmt.b32 t, $2, $3, 0x{4 + b}{4 + b}{b}{b};"
    if half:
        masks = "shl.b32 t, t, 3; lop3.b32 $0, t, 0x00780078, 0x38003800, 0xEA;"
        masks += " lop3.b32 $1, t, 0x07800780, 0x38003800, 0xEA;"
    else:
        masks = "lop3.b32 $0, t, 0x000F000F, 0x3F003F00, 0xEA; lop3.b32 $1, t, 0x00F000F0, 0x3F003F00, 0xEA;"
    return tl.constexpr("{.reg .b32 t; " + select + " " + masks + "}")


_BF16_BYTE0, _BF16_BYTE1, _BF16_BYTE2, _BF16_BYTE3 = (_nibble_values_asm(b, False) for b in range(4))
_HALF_BYTE0, _HALF_BYTE1, _HALF_BYTE2, _HALF_BYTE3 = (_nibble_values_asm(b, True) for b in range(4))


@triton.jit
def nibble_values(words, b: tl.constexpr, VALUES: tl.constexpr, PRMT: tl.constexpr):
    """The low and high nibbles q of byte b of each nibble word (a Q4_K lane word's sub-blocks 2b and 2b + 1; an
    int4 word's values 2b and 2b + 1), shaped as `words`, exactly: for 16-bit activations (VALUES "bf16" or "f16")
    as the floats 0.5 + q / 256 and 0.5 + q / 16 of their type, on CUDA one permute per two words and one masked
    or per nibble and pair (`_nibble_values_asm`); for float32 activations q itself."""
    if VALUES == "f32":
        low = quant_bits.as_float((words >> (8 * b)) & 0xF)
        high = quant_bits.as_float((words >> (8 * b + 4)) & 0xF)
    elif not PRMT:
        low = 0.5 + quant_bits.as_float((words >> (8 * b)) & 0xF) / 256.0
        high = 0.5 + quant_bits.as_float((words >> (8 * b + 4)) & 0xF) / 16.0
    else:
        if b == 0:
            f16_asm: tl.constexpr = _HALF_BYTE0
            bf16_asm: tl.constexpr = _BF16_BYTE0
        elif b == 1:
            f16_asm: tl.constexpr = _HALF_BYTE1
            bf16_asm: tl.constexpr = _BF16_BYTE1
        elif b == 2:
            f16_asm: tl.constexpr = _HALF_BYTE2
            bf16_asm: tl.constexpr = _BF16_BYTE2
        else:
            f16_asm: tl.constexpr = _HALF_BYTE3
            bf16_asm: tl.constexpr = _BF16_BYTE3
        if VALUES == "f16":
            low, high = tl.inline_asm_elementwise(
                f16_asm, "=r,=r,r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
            )
        else:
            low, high = tl.inline_asm_elementwise(
                bf16_asm, "=r,=r,r,r", [words], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2
            )
    return low, high


@triton.jit
def _q6_k_half_lanes(words_ptr, high_ptr, step, half: tl.constexpr, cols, n_mask, N):
    """Lanes 16 * half .. + 15 [16, BLOCK_N] of super-block `step`'s Q6_K rows `cols`, as two words of bytes
    2v (v the 6-bit value): byte b = 2h + r of `low` holds quarter r of half h, of `high` quarter 2 + r."""
    lane = tl.arange(0, 16)
    words = tl.load(
        words_ptr + (step * 32 + half * 16 + lane)[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0
    )
    top = tl.load(high_ptr + (step * 16 + lane)[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0)
    top = (top >> (4 * half)) & 0x0F0F0F0F  # this half's lanes: quarter r's bits at 0-1, quarter 2 + r's at 2-3
    low = ((words << 1) & 0x1E1E1E1E) | ((top & 0x03030303) << 5)
    high = ((words >> 3) & 0x1E1E1E1E) | ((top & 0x0C0C0C0C) << 3)
    return low, high


@triton.jit
def plus_dot_product(acc, x, w, IEEE: tl.constexpr):
    """acc + x [BLOCK_M, K] times w [K, BLOCK_N] (`dot_product`), added inside the tensor-core product."""
    if IEEE:
        return acc + dot_product(x, w, IEEE)
    return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def q4_k_mma_kernel(
    x_ptr,
    words_ptr,
    heads_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    half_exponent,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
    IEEE: tl.constexpr,
    VALUES: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the repacked Q4_K rows on tensor cores. Per sub-block j the quants q,
    for 16-bit activations as the exact floats f = 0.5 + q / c of their type (c = 256 for even j, 16 for odd:
    `nibble_values`), multiply x's 32 columns of that sub-block into P, and ones into their sum X; the value
    scale * q - min adds (c * scale) * P - (c / 2 * scale + min) * X to the float32 sums, two multiply-adds per
    sum (float32 activations: f = q, scale * P - min * X, which cancels less)."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    lane = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ones = tl.full((32, BLOCK_N), 1.0, tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        d, dmin, s0, s1, s2 = _q4_k_head(heads_ptr, step, cols, n_mask, N)
        words = tl.load(
            words_ptr + (step * 32 + lane)[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0
        )  # [32, BLOCK_N]: lane l of the eight sub-blocks
        for b in tl.static_range(4):
            low, high = nibble_values(words, b, VALUES, PRMT)
            for upper in tl.static_range(2):
                j = 2 * b + upper
                sc, mn = _q4_k_sub_block(s0, s1, s2, j)
                scale = d * quant_bits.as_float(sc)  # [BLOCK_N]
                x = tl.load(
                    x_ptr + m[:, None] * stride_xm + (step * 256 + j * 32 + lane)[None, :],
                    mask=m_mask[:, None],
                    other=0,
                )
                minimum = dmin * quant_bits.as_float(mn)
                if upper == 0:
                    sums = dot_product(x, low, IEEE)
                else:
                    sums = dot_product(x, high, IEEE)
                if VALUES == "f32":
                    slope = scale
                    offset = minimum
                else:
                    slope = scale * (256.0 if upper == 0 else 16.0)
                    offset = 0.5 * slope + minimum
                acc = tl.fma(sums, slope[None, :], acc)
                acc = tl.fma(dot_product(x, ones, IEEE), -offset[None, :], acc)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, acc, m, cols, n_mask, M, N, stride_om)


@triton.jit
def dot_product(x, w, IEEE: tl.constexpr):
    """x [BLOCK_M, K] times w [K, BLOCK_N] (values exact in x's dtype) on the tensor cores, in float32; without TF32
    rounding for float32 activations or under the interpreter (IEEE)."""
    if IEEE:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(x, w.to(x.dtype))


@triton.jit
def q4_k_gemv_kernel(
    x_ptr,
    words_ptr,
    heads_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    half_exponent,
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
):
    """The Q4_K product on CUDA cores for a few rows (M <= M_BLOCK): per sub-block the sums F of f * x and X of x,
    and 32 * scale * F - (16 * scale + min) * X."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, M_BLOCK)
    x_rows = x_ptr + tl.minimum(m, M - 1)[:, None] * stride_xm  # [M_BLOCK, 1]
    lane = tl.arange(0, 32)
    acc = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        d, dmin, s0, s1, s2 = _q4_k_head(heads_ptr, step, cols, n_mask, N)
        low, high = _q4_k_lanes(words_ptr, step, cols, n_mask, N)
        for j in tl.static_range(8):
            sc, mn = _q4_k_sub_block(s0, s1, s2, j)
            scale = d * quant_bits.as_float(sc)
            offset = 16.0 * scale + dmin * quant_bits.as_float(mn)
            f = _q4_k_sub_block_values(low, high, j, half_exponent, PRMT)  # [32, BLOCK_N]
            x = tl.load(x_rows + step * 256 + j * 32 + lane[None, :]).to(tl.float32)  # [M_BLOCK, 32]
            sums = tl.sum(f[None, :, :] * x[:, :, None], axis=1)  # [M_BLOCK, BLOCK_N]
            acc += (32.0 * scale)[None, :] * sums - offset[None, :] * tl.sum(x, axis=1)[:, None]
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, acc, m, cols, n_mask, M, N, stride_om)


@triton.jit
def q6_k_gemv_kernel(
    x_ptr,
    words_ptr,
    high_ptr,
    scales_ptr,
    d_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    half_exponent,
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
):
    """The Q6_K product on CUDA cores for a few rows (M <= M_BLOCK): per 16-value scale group the sums F of
    f * x and X of x, and 128 * d * scale * (F - 0.75 * X) (`q6_k_mma_kernel`'s values)."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, M_BLOCK)
    x_rows = x_ptr + tl.minimum(m, M - 1)[:, None] * stride_xm  # [M_BLOCK, 1]
    lane = tl.arange(0, 16)
    acc = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        d128 = 128.0 * tl.load(d_ptr + step * N + cols, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(
            tl.float32
        )
        for half in tl.static_range(2):
            low, high = _q6_k_half_lanes(words_ptr, high_ptr, step, half, cols, n_mask, N)
            for b in tl.static_range(4):
                for upper in tl.static_range(2):
                    quarter = b % 2 + 2 * upper
                    group = (b // 2) * 8 + quarter * 2 + half
                    scale = tl.load(scales_ptr + (step * 16 + group) * N + cols, mask=n_mask, other=0).to(tl.float32)
                    if upper == 0:
                        f = quant_bits.byte_as_float(low, b, half_exponent, PRMT)  # [16, BLOCK_N]
                    else:
                        f = quant_bits.byte_as_float(high, b, half_exponent, PRMT)
                    column = step * 256 + (b // 2) * 128 + quarter * 32 + half * 16
                    x = tl.load(x_rows + column + lane[None, :]).to(tl.float32)  # [M_BLOCK, 16]
                    sums = tl.sum(f[None, :, :] * x[:, :, None], axis=1)  # [M_BLOCK, BLOCK_N]
                    acc += (d128 * scale)[None, :] * (sums - 0.75 * tl.sum(x, axis=1)[:, None])
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, acc, m, cols, n_mask, M, N, stride_om)


def gemv(
    x: torch.Tensor,
    planes: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    layout: str,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """out [M, N] = x [M, in] times a repacked matrix of `layout` (its `repacked.planes`) on CUDA cores, all M rows
    in one row block."""
    grid, shared = launch_shares(x, out, block_n, split_k)
    kernel = q6_k_gemv_kernel if layout == "Q6_K_R" else q4_k_gemv_kernel
    kernel[grid](
        x,
        *planes,
        *shared,
        quant_bits.HALF_EXPONENT,
        PRMT=not INTERPRETED,
        BLOCK_N=block_n,
        M_BLOCK=triton.next_power_of_2(out.shape[0]),
        NUM_STAGES=num_stages,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out


@triton.jit
def q6_k_mma_kernel(
    x_ptr,
    words_ptr,
    high_ptr,
    scales_ptr,
    d_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    half_exponent,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the repacked Q6_K rows: per half of the lanes, the 6-bit values v as
    bytes 2v of two words (`_q6_k_half_lanes`), and per 16-value scale group the floats f = 0.5 + v / 128 and the
    values (128 * d * scale) * f - 96 * d * scale = d * scale * (v - 32), one multiply-add and the reference's
    float32 value exactly, rounded to x's dtype and multiplied by x's 16 matching columns on the tensor cores."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        d = tl.load(d_ptr + step * N + cols, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        d128 = 128.0 * d
        for half in tl.static_range(2):
            low, high = _q6_k_half_lanes(words_ptr, high_ptr, step, half, cols, n_mask, N)
            for b in tl.static_range(4):
                for upper in tl.static_range(2):
                    quarter = b % 2 + 2 * upper
                    group = (b // 2) * 8 + quarter * 2 + half  # the 16 values' scale
                    scale = tl.load(scales_ptr + (step * 16 + group) * N + cols, mask=n_mask, other=0).to(tl.float32)
                    slope = d128 * scale  # 128 * d * scale and 96 * d * scale are exact in float32
                    if upper == 0:
                        f = quant_bits.byte_as_float(low, b, half_exponent, PRMT)  # 0.5 + v / 128
                    else:
                        f = quant_bits.byte_as_float(high, b, half_exponent, PRMT)
                    w = slope[None, :] * f - (0.75 * slope)[None, :]  # d * scale * (v - 32), exactly
                    column = step * 256 + (b // 2) * 128 + quarter * 32 + half * 16 + tl.arange(0, 16)
                    x = tl.load(x_ptr + m[:, None] * stride_xm + column[None, :], mask=m_mask[:, None], other=0)
                    acc = plus_dot_product(acc, x, w, IEEE)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, acc, m, cols, n_mask, M, N, stride_om)


def mma(
    x: torch.Tensor,
    planes: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    layout: str,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """out [M, N] (row stride free) = x [M, in] (contiguous rows) times a repacked matrix of `layout` (Q4_K_R or
    Q6_K_R, its `repacked.planes`) on tensor cores."""
    grid, shared = launch_shares(x, out, block_n, split_k)
    kernel = q6_k_mma_kernel if layout == "Q6_K_R" else q4_k_mma_kernel
    kernel[grid](
        x,
        *planes,
        *shared,
        quant_bits.HALF_EXPONENT,
        BLOCK_M=max(16, triton.next_power_of_2(out.shape[0])),
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        PRMT=not INTERPRETED,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
        **({} if layout == "Q6_K_R" else {"VALUES": VALUES_OF[x.dtype]}),
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out


VALUES_OF = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # `nibble_values`


def launch_shares(x: torch.Tensor, out: torch.Tensor, block_n: int, split_k: int) -> tuple[tuple[int, int], tuple]:
    """A product's grid (output tiles, input shares) and the arguments every kernel here takes after its planes:
    the float32 workspace of the shares' sums (the output itself for one share), the arrival counts, out, M, N,
    x's and out's row strides, the super-blocks and the super-blocks per share (`quant_bits.store_or_add_shares`)."""
    m, n = out.shape
    steps = x.shape[1] // 256
    per_share = triton.cdiv(steps, split_k)
    shares = triton.cdiv(steps, per_share)
    parts = torch.empty(shares, m, n, device=x.device, dtype=torch.float32) if shares > 1 else out
    grid = (triton.cdiv(n, block_n), shares)
    arrivals = quant_bits.arrival_counts(x.device, triton.next_power_of_2(grid[0]))
    return grid, (parts, arrivals, out, m, n, x.stride(0), out.stride(0), steps, per_share)


@triton.jit
def dequantize_kernel(
    words_ptr, heads_ptr, high_ptr, scales_ptr, d_ptr, out_ptr, N, stride_on, Q6_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """out[rows, step * 256 : (step + 1) * 256] for program (row tile, step) of a repacked Q4_K or Q6_K matrix,
    in float32 as the reference dequantizes, rounded to out's dtype (the planes of Q4_K_R are words and heads)."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1)
    n_mask = cols < N
    k = tl.arange(0, 32)
    out_at = out_ptr + cols.to(tl.int64)[None, :] * stride_on + step * 256 + k[:, None]  # [32, BLOCK_N]
    if Q6_K:
        d = tl.load(d_ptr + step * N + cols, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        for half in tl.static_range(2):
            low, high = _q6_k_half_lanes(words_ptr, high_ptr, step, half, cols, n_mask, N)
            lane = tl.arange(0, 16)
            for b in tl.static_range(4):
                for upper in tl.static_range(2):
                    quarter = b % 2 + 2 * upper
                    group = (b // 2) * 8 + quarter * 2 + half
                    scale = tl.load(scales_ptr + (step * 16 + group) * N + cols, mask=n_mask, other=0).to(tl.float32)
                    if upper == 0:
                        v = (low >> (8 * b + 1)) & 63
                    else:
                        v = (high >> (8 * b + 1)) & 63
                    w = (d * scale)[None, :] * (v - 32).to(tl.float32)  # the reference's arithmetic
                    at = out_ptr + cols.to(tl.int64)[None, :] * stride_on + step * 256 + (b // 2) * 128
                    at += quarter * 32 + half * 16 + lane[:, None]
                    tl.store(at, w.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:
        d, dmin, s0, s1, s2 = _q4_k_head(heads_ptr, step, cols, n_mask, N)
        words = tl.load(words_ptr + (step * 32 + k)[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0)
        for j in tl.static_range(8):  # sub-block j: nibble j % 2 of byte j // 2 (the reference's arithmetic)
            sc, mn = _q4_k_sub_block(s0, s1, s2, j)
            q = quant_bits.as_float((words >> (8 * (j // 2) + 4 * (j % 2))) & 0xF)
            w = q * (d * quant_bits.as_float(sc))[None, :] - (dmin * quant_bits.as_float(mn))[None, :]
            tl.store(out_at + j * 32, w.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def dequantize(data: torch.Tensor, layout: str, columns: int, dtype: torch.dtype, out: torch.Tensor | None = None):
    """The float matrix [rows, columns] of a repacked segment `data` (`Q4_K_R` or `Q6_K_R`), in `dtype` (written
    into `out`, a row-contiguous view, when given)."""
    rows = data.shape[0]
    if out is None:
        out = torch.empty(rows, columns, device=data.device, dtype=dtype)
    parts = repacked.planes(data, layout, columns)
    q6_k = layout == "Q6_K_R"
    words, heads, high, scales, d = (parts[0], parts[0], *parts[1:]) if q6_k else (*parts, parts[0], parts[0], parts[0])
    grid = (triton.cdiv(rows, DEQUANT_BLOCK_N), columns // 256)
    dequantize_kernel[grid](
        words, heads, high, scales, d, out, rows, out.stride(0), Q6_K=q6_k, BLOCK_N=DEQUANT_BLOCK_N, **pdl.LAUNCH
    )
    return out
