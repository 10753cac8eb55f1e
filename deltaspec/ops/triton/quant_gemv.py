"""`x @ weight.T` from GGUF blocks for the few input rows of decode and short verify passes, on CUDA cores
without tensor cores.

A program owns BLOCK_N weight rows, ROWS rows of x and a share of the input dimension, and walks it one
256-value super-block at a time. Nothing is dequantized into a float tile: each packed word is read once
(16-byte vectors of 32-bit words where the layout is 4-byte aligned, 16-bit words otherwise), the quants of
four (or two) values at once become bytes 0x80 | q, and each byte becomes the float f = 1 + q / 2**s with one
permute (`byte_as_float`), which is multiplied by the matching activation of every x row and summed per
sub-block. With F that sum and X the sum of the activations, the sub-block's sum of q * x is 2**s * (F - X);
its scale is applied once to it, and a k-quant's min once to X (the algebra of `deltaspec.ops.quant.dequant`,
in float32, within a few float32 roundings of the float64 product). So the unpacking is shared by the ROWS
rows and each costs one multiply-add per value. Program `grid(1)` takes super-blocks
[s * steps_per_split, (s + 1) * steps_per_split) (the last share may be shorter); with several shares the
partial sums go to a float32 workspace [shares, M, N] that `finish_kernel` reduces in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

BYTE_TOPS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: bit 7 of every byte


@triton.jit
def as_float(q):
    """Small non-negative integers (int32) as float32, exactly, without an int-to-float conversion."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def half_bits(bits):
    """The float16 whose bits are the low 16 bits of int32 `bits`, as float32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def byte_as_float(word, k: tl.constexpr, PRMT: tl.constexpr):
    """Byte k of each int32 of `word`, a byte 0x80 | v with v < 128, as the float32 1 + v / 128, exactly: the byte
    becomes bits 16..23 under the exponent byte 0x3F and zero low bytes. On CUDA one `prmt` per value. Quants
    are placed at the byte's top bits (v = q << 3 for 4 bits) so that f - 1 keeps most of the float's bits."""
    if PRMT:
        bits = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [word, tl.full(word.shape, 0x3F000000, tl.int32), tl.full(word.shape, 0x7044 + k * 0x100, tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        bits = (((word >> (8 * k)) & 0xFF) << 16) | 0x3F000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def byte_as_biased_float(word, k: tl.constexpr, PRMT: tl.constexpr):
    """Byte k of each int32 of `word` as the float32 2**23 + byte (the byte under the exponent of 2**23)."""
    if PRMT:
        bits = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [word, tl.full(word.shape, 0x4B000000, tl.int32), tl.full(word.shape, 0x7650 + k, tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        bits = ((word >> (8 * k)) & 0xFF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_rows(x_ptr, order_ptr, x_row, m_mask, positions, HAS_ORDER: tl.constexpr):
    """Activations [ROWS, *positions.shape] of x rows `x_row` ([ROWS] offsets, masked by `m_mask`) at stored
    columns `positions` (gathered through the weight's input order), as float32."""
    if HAS_ORDER:
        positions = tl.load(order_ptr + positions)
    if len(positions.shape) == 2:
        at, mask = x_row[:, None, None], m_mask[:, None, None]
    else:
        at, mask = x_row[:, None, None, None], m_mask[:, None, None, None]
    return tl.load(x_ptr + at + positions[None], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(part_ptr, out_ptr, value, m, m_mask, rows, n_mask, split, M, N, stride_om):
    """This program's result [ROWS, BLOCK_N] for x rows `m`: straight into the output (in its dtype) when one
    share covers the whole input, else into the float32 workspace [shares, M, N] that `finish_kernel` sums."""
    mask = m_mask[:, None] & n_mask[None, :]
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + m[:, None] * stride_om + rows[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * M + m[:, None]) * N + rows[None, :], value, mask=mask)


@triton.jit
def q4_k_gemv_kernel(
    x_ptr,
    order_ptr,
    w32_ptr,
    part_ptr,
    out_ptr,
    M,
    N,
    row_words,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PRMT: tl.constexpr,
):
    """Q4_K: words 0 (d | dmin), 1..3 (12 bytes of 6-bit scales and mins), 4..35 (nibbles) of each 144-byte
    super-block. Word 4 + c * 8 + i, byte k, holds value c * 64 + i * 4 + k (low nibble, sub-block 2c) and
    c * 64 + 32 + i * 4 + k (high nibble, sub-block 2c + 1). Nibbles become bytes 0x80 | q << 3: f = 1 + q / 16."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    n_mask = rows < N
    m_mask = m < M
    x_row = m * stride_xm
    row_start = rows.to(tl.int64) * row_words  # [BLOCK_N] words
    chunk = tl.arange(0, 4)
    word = chunk[:, None] * 8 + tl.arange(0, 8)[None, :]  # [4, 8]: word of chunk c, position i
    column = chunk[:, None] * 64 + tl.arange(0, 8)[None, :] * 4  # [4, 8]: the value of byte 0's low nibble
    shift = (chunk[None, :] % 2) * 16
    acc = tl.zeros((ROWS, BLOCK_N, 4), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        block = row_start + step * 36  # [BLOCK_N]
        quants = tl.load(w32_ptr + block[:, None, None] + 4 + word[None, :, :], mask=n_mask[:, None, None], other=0)
        head = tl.load(w32_ptr + block, mask=n_mask, other=0)
        s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
        s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
        s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
        low = ((quants << 3) & 0x78787878) | BYTE_TOPS  # [BLOCK_N, 4, 8]: bytes 0x80 | q << 3 of sub-block 2c
        high = ((quants >> 1) & 0x78787878) | BYTE_TOPS  # sub-block 2c + 1
        f_low = tl.zeros((ROWS, BLOCK_N, 4, 8), dtype=tl.float32)
        f_high = tl.zeros((ROWS, BLOCK_N, 4, 8), dtype=tl.float32)
        x_low = tl.zeros((ROWS, 4, 8), dtype=tl.float32)
        x_high = tl.zeros((ROWS, 4, 8), dtype=tl.float32)
        for k in tl.static_range(4):
            xv = _x_rows(x_ptr, order_ptr, x_row, m_mask, step * 256 + column + k, HAS_ORDER)  # [ROWS, 4, 8]
            f_low += byte_as_float(low, k, PRMT)[None] * xv[:, None, :, :]
            x_low += xv
            xv = _x_rows(x_ptr, order_ptr, x_row, m_mask, step * 256 + column + 32 + k, HAS_ORDER)
            f_high += byte_as_float(high, k, PRMT)[None] * xv[:, None, :, :]
            x_high += xv
        d = half_bits(head) * 16.0
        dmin = half_bits(head >> 16)
        # sub-block j's 6-bit scale and min: j < 4 in bytes j of s0 / s1, j >= 4 split over s2 and the top bits
        sc_word = tl.where(
            chunk[None, :] < 2, (s0 & 0x3F3F3F3F)[:, None], ((s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))[:, None]
        )
        min_word = tl.where(
            chunk[None, :] < 2,
            (s1 & 0x3F3F3F3F)[:, None],
            (((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))[:, None],
        )  # [BLOCK_N, 4]: bytes of sub-blocks 2c, 2c + 1 at (c % 2) * 2
        scale_low = (d[:, None] * as_float((sc_word >> shift) & 0xFF))[None]  # [1, BLOCK_N, 4]
        scale_high = (d[:, None] * as_float((sc_word >> (shift + 8)) & 0xFF))[None]
        min_low = (dmin[:, None] * as_float((min_word >> shift) & 0xFF))[None]
        min_high = (dmin[:, None] * as_float((min_word >> (shift + 8)) & 0xFF))[None]
        sums_low = tl.sum(x_low, axis=2)[:, None, :]  # [ROWS, 1, 4]
        sums_high = tl.sum(x_high, axis=2)[:, None, :]
        acc += scale_low * (tl.sum(f_low, axis=3) - sums_low) - min_low * sums_low
        acc += scale_high * (tl.sum(f_high, axis=3) - sums_high) - min_high * sums_high
    _store_rows(part_ptr, out_ptr, tl.sum(acc, axis=2), m, m_mask, rows, n_mask, split, M, N, stride_om)


@triton.jit
def q6_k_gemv_kernel(
    x_ptr,
    order_ptr,
    w_ptr,
    w16_ptr,
    part_ptr,
    out_ptr,
    M,
    N,
    row_bytes,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PRMT: tl.constexpr,
):
    """Q6_K: 210-byte super-blocks of 128 bytes of low nibbles (ql), 64 bytes of high bit pairs (qh), 16 int8
    scales and an fp16 d, read as 16-bit words (the blocks are 2-byte aligned). For half h, quarter q and
    position l < 32, value h * 128 + q * 32 + l is ql[h * 64 + (q % 2) * 32 + l] nibble q // 2 with
    bits 2q..2q+1 of qh[h * 32 + l] on top, minus 32, times scale h * 8 + q * 2 + l // 16. The 6-bit values v
    become bytes 0x80 | v << 1: f = 1 + v / 64, and a scale group's sum of (v - 32) * x is 64 * (F - 1.5 * X)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    n_mask = rows < N
    m_mask = m < M
    x_row = m * stride_xm
    mask4 = n_mask[:, None, None, None]
    row_start = rows.to(tl.int64) * row_bytes  # [BLOCK_N] bytes
    half = tl.arange(0, 2)[:, None, None]
    group = tl.arange(0, 2)[None, :, None]
    pair = group * 8 + tl.arange(0, 8)[None, None, :]  # [2, 2, 8]: 16-bit word p = g * 8 + p' of a half
    scale_slot = tl.arange(0, 2)[:, None] * 8 + tl.arange(0, 2)[None, :]  # [2, 2]: h * 8 + g
    acc = tl.zeros((ROWS, BLOCK_N, 2, 2), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        block = row_start + step * 210  # [BLOCK_N] bytes
        half_words = (block // 2)[:, None, None, None]
        low0 = tl.load(w16_ptr + half_words + half * 32 + pair, mask=mask4, other=0).to(tl.int32)
        low1 = tl.load(w16_ptr + half_words + half * 32 + 16 + pair, mask=mask4, other=0).to(tl.int32)
        high = tl.load(w16_ptr + half_words + 64 + half * 16 + pair, mask=mask4, other=0).to(tl.int32)
        d = half_bits(tl.load(w16_ptr + block // 2 + 104, mask=n_mask, other=0).to(tl.int32)) * 64.0
        for q in tl.static_range(4):
            if q % 2 == 0:
                nibbles = (low0 >> (4 * (q // 2))) & 0x0F0F
            else:
                nibbles = (low1 >> (4 * (q // 2))) & 0x0F0F
            if q == 0:
                top = (high << 4) & 0x3030
            elif q == 1:
                top = (high << 2) & 0x3030
            elif q == 2:
                top = high & 0x3030
            else:
                top = (high >> 2) & 0x3030
            six = ((nibbles | top) << 1) | 0x8080  # [BLOCK_N, 2, 2, 8]: two bytes 0x80 | v << 1
            products = tl.zeros((ROWS, BLOCK_N, 2, 2, 8), dtype=tl.float32)
            x_sum = tl.zeros((ROWS, 2, 2, 8), dtype=tl.float32)
            for b in tl.static_range(2):
                positions = step * 256 + half * 128 + q * 32 + pair * 2 + b
                xv = _x_rows(x_ptr, order_ptr, x_row, m_mask, positions, HAS_ORDER)  # [ROWS, 2, 2, 8]
                products += byte_as_float(six, b, PRMT)[None] * xv[:, None, :, :, :]
                x_sum += xv
            scale_at = block[:, None, None] + 192 + scale_slot[None, :, :] + q * 2
            scale = tl.load(w_ptr + scale_at, mask=n_mask[:, None, None], other=0).to(tl.int8, bitcast=True)
            sums = tl.sum(x_sum, axis=3)[:, None, :, :]  # [ROWS, 1, 2, 2]
            acc += (d[:, None, None] * scale.to(tl.float32))[None] * (tl.sum(products, axis=4) - 1.5 * sums)
    _store_rows(part_ptr, out_ptr, tl.sum(tl.sum(acc, axis=3), axis=2), m, m_mask, rows, n_mask, split, M, N, stride_om)


@triton.jit
def q8_0_gemv_kernel(
    x_ptr,
    order_ptr,
    w16_ptr,
    part_ptr,
    out_ptr,
    M,
    N,
    row_halves,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PRMT: tl.constexpr,
):
    """Q8_0: 34-byte blocks of an fp16 d and 32 int8 quants, read as 16-bit words, eight blocks (256 values)
    per step. Byte b of word 1 + w of a block is value w * 2 + b. Quants q become bytes q + 128, each the float
    2**23 + q + 128 (`byte_as_biased_float`), from which one subtraction gives q exactly."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    n_mask = rows < N
    m_mask = m < M
    x_row = m * stride_xm
    row_start = rows.to(tl.int64) * row_halves  # [BLOCK_N] 16-bit words
    block_of_step = tl.arange(0, 8)
    blocks = block_of_step[:, None]
    word = tl.arange(0, 16)[None, :]
    acc = tl.zeros((ROWS, BLOCK_N, 8), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        block = row_start[:, None] + step * 136 + block_of_step[None, :] * 17  # [BLOCK_N, 8]
        quants = tl.load(w16_ptr + block[:, :, None] + 1 + word[None, :, :], mask=n_mask[:, None, None], other=0)
        biased = quants.to(tl.int32) ^ 0x8080  # [BLOCK_N, 8, 16]: two bytes q + 128
        d = half_bits(tl.load(w16_ptr + block, mask=n_mask[:, None], other=0).to(tl.int32))  # [BLOCK_N, 8]
        products = tl.zeros((ROWS, BLOCK_N, 8, 16), dtype=tl.float32)
        for b in tl.static_range(2):
            xv = _x_rows(x_ptr, order_ptr, x_row, m_mask, step * 256 + blocks * 32 + word * 2 + b, HAS_ORDER)
            q = byte_as_biased_float(biased, b, PRMT) - 8388736.0  # 2**23 + 128
            products += q[None] * xv[:, None, :, :]
        acc += d[None] * tl.sum(products, axis=3)
    _store_rows(part_ptr, out_ptr, tl.sum(acc, axis=2), m, m_mask, rows, n_mask, split, M, N, stride_om)


@triton.jit
def finish_kernel(part_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over s of part[s, m, n], in order s = 0, 1, ..., cast to the output's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(part_ptr + s * M * N + offsets, mask=mask, other=0.0)
    out = out_ptr + (offsets // N) * stride_om + offsets % N
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
