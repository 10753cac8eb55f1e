"""`x @ weight.T` from GGUF blocks (Q4_K, Q6_K, Q8_0) for a few input rows (decode, and the verify passes of
speculative decoding), on CUDA cores without tensor cores; the block formats packed from Hugging Face checkpoints
take the same design in `quant_gemv_hf`.

A program owns BLOCK_N weight rows, a block of M_BLOCK rows of x and a share of the input dimension, and walks it
one 256-value super-block at a time; each value it decodes is multiplied by the matching activations of all M_BLOCK
rows, so a pass of a few rows reads and decodes the weight once. Nothing is dequantized into a float
tile: each packed word is read once (16-byte vectors of 32-bit words where the layout is 4-byte aligned, 16-bit
words otherwise), the quants of four (or two) values at once are masked into the top bits of bytes, and each byte
becomes the float f = 0.5 + q / 2**s with one permute under a fixed exponent (`quant_bits.byte_as_float`), which is
multiplied by the matching activation and summed per sub-block. With F that sum and X the sum of the activations,
the sub-block's sum of q * x is 2**s * (F - X / 2) (the quants sit at the top of the byte so that F - X / 2 keeps
most bits); its scale is applied once to it, and a k-quant's min once to X (the algebra of
`deltaspec.ops.quant.dequant`, in float32, within a few float32 roundings of the float64 product). Q8_0's signed
bytes become 2**23 + q + 128 instead (`quant_bits.byte_as_biased_float`), from which one subtraction gives q.
`grid(0)` walks the row blocks of x fastest (program t * row_blocks + b takes weight tile t and row block b), so
the row blocks of a weight tile run side by side and share its reads through L2; rows past the last of x repeat it
and are not stored. Program `grid(1)` takes super-blocks [s * steps_per_split, (s + 1) * steps_per_split) (the
last share may be shorter); with several shares the partial sums go to a float32 workspace [shares, M, N], and the
last program of an output tile to finish adds them in a fixed order (`quant_bits.store_or_add_shares`). Each
kernel's product of BLOCK_N weight rows with M_BLOCK activation rows is a function (`q4_k_block`, `q6_k_block`,
`q8_0_block`); its one-row form (`q4_k_rows`, `q6_k_rows`, `q8_0_rows`) is what the mixture-of-experts decode
kernels call on one expert's rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_bits


@triton.jit
def q4_k_gemv_kernel(
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
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """Q4_K: words 0 (d | dmin), 1..3 (12 bytes of 6-bit scales and mins), 4..35 (nibbles) of each 144-byte
    super-block. Word 4 + c * 8 + i, byte k, holds value c * 64 + i * 4 + k (low nibble, sub-block 2c) and
    c * 64 + 32 + i * 4 + k (high nibble, sub-block 2c + 1). Nibbles q become bytes q << 3 and f = 0.5 + q / 32,
    so a sub-block's sum of q * x is 32 * (F - X / 2)."""
    pdl.wait_for_previous()
    rows, n_mask, m, x_rows, first, last = quant_bits.program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_words  # [BLOCK_N] words
    value = q4_k_block(
        x_rows, order_ptr, w32_ptr, row_start, n_mask, first, last, half_exponent, HAS_ORDER, BLOCK_N, PRMT, M_BLOCK
    )
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


@triton.jit
def q4_k_rows(
    x_row,
    order_ptr,
    w32_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
):
    """[BLOCK_N] float32: `q4_k_block` for the one activation row at x_row."""
    x_rows = x_row + tl.zeros((1,), dtype=tl.int32)
    value = q4_k_block(
        x_rows, order_ptr, w32_ptr, row_start, n_mask, first, last, half_exponent, HAS_ORDER, BLOCK_N, PRMT, 1
    )
    return tl.sum(value, axis=0)


@triton.jit
def q4_k_block(
    x_rows,
    order_ptr,
    w32_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """[M_BLOCK, BLOCK_N] float32: the Q4_K rows starting at words `row_start` [BLOCK_N] times the activation rows
    at pointers `x_rows` [M_BLOCK], over super-blocks [first, last) (the layout and algebra of
    `q4_k_gemv_kernel`)."""
    x_at = x_rows[:, None, None]  # [M_BLOCK, 1, 1]
    chunk = tl.arange(0, 4)
    word = chunk[:, None] * 8 + tl.arange(0, 8)[None, :]  # [4, 8]: word of chunk c, position i
    column = chunk[:, None] * 64 + tl.arange(0, 8)[None, :] * 4  # [4, 8]: the value of byte 0's low nibble
    shift = (chunk[None, :] % 2) * 16
    acc = tl.zeros((M_BLOCK, BLOCK_N, 4), dtype=tl.float32)
    for step in range(first, last):
        block = row_start + step * 36  # [BLOCK_N]
        quants = tl.load(
            w32_ptr + block[None, :, None, None] + 4 + word[None, None], mask=n_mask[None, :, None, None], other=0
        )  # [1, BLOCK_N, 4, 8]
        head = tl.load(w32_ptr + block, mask=n_mask, other=0)
        s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
        s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
        s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
        low = (quants << 3) & 0x78787878  # [1, BLOCK_N, 4, 8]: bytes q << 3 of sub-block 2c
        high = (quants >> 1) & 0x78787878  # sub-block 2c + 1
        f_low = tl.zeros((M_BLOCK, BLOCK_N, 4, 8), dtype=tl.float32)
        f_high = tl.zeros((M_BLOCK, BLOCK_N, 4, 8), dtype=tl.float32)
        x_low = tl.zeros((M_BLOCK, 4, 8), dtype=tl.float32)
        x_high = tl.zeros((M_BLOCK, 4, 8), dtype=tl.float32)
        for k in tl.static_range(4):
            xv = quant_bits.activations_at(x_at, order_ptr, step * 256 + column + k, HAS_ORDER)  # [M_BLOCK, 4, 8]
            f_low += quant_bits.byte_as_float(low, k, half_exponent, PRMT) * xv[:, None]
            x_low += xv
            xv = quant_bits.activations_at(x_at, order_ptr, step * 256 + column + 32 + k, HAS_ORDER)
            f_high += quant_bits.byte_as_float(high, k, half_exponent, PRMT) * xv[:, None]
            x_high += xv
        d = quant_bits.half_bits(head) * 32.0
        dmin = quant_bits.half_bits(head >> 16)
        # sub-block j's 6-bit scale and min: j < 4 in bytes j of s0 / s1, j >= 4 split over s2 and the top bits
        sc_word = tl.where(
            chunk[None, :] < 2, (s0 & 0x3F3F3F3F)[:, None], ((s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030))[:, None]
        )
        min_word = tl.where(
            chunk[None, :] < 2,
            (s1 & 0x3F3F3F3F)[:, None],
            (((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))[:, None],
        )  # [BLOCK_N, 4]: bytes of sub-blocks 2c, 2c + 1 at (c % 2) * 2
        sums_low = tl.sum(x_low, axis=2)[:, None, :]  # [M_BLOCK, 1, 4]
        sums_high = tl.sum(x_high, axis=2)[:, None, :]
        scale_low = (d[:, None] * quant_bits.as_float((sc_word >> shift) & 0xFF))[None]  # [1, BLOCK_N, 4]
        scale_high = (d[:, None] * quant_bits.as_float((sc_word >> (shift + 8)) & 0xFF))[None]
        min_low = (dmin[:, None] * quant_bits.as_float((min_word >> shift) & 0xFF))[None]
        min_high = (dmin[:, None] * quant_bits.as_float((min_word >> (shift + 8)) & 0xFF))[None]
        acc += scale_low * (tl.sum(f_low, axis=3) - 0.5 * sums_low) - min_low * sums_low
        acc += scale_high * (tl.sum(f_high, axis=3) - 0.5 * sums_high) - min_high * sums_high
    return tl.sum(acc, axis=2)


@triton.jit
def q6_k_gemv_kernel(
    x_ptr,
    order_ptr,
    w_ptr,
    w16_ptr,
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
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """Q6_K: 210-byte super-blocks of 128 bytes of low nibbles (ql), 64 bytes of high bit pairs (qh), 16 int8
    scales and an fp16 d, read as 16-bit words (the blocks are 2-byte aligned). For half h, quarter q and
    position l < 32, value h * 128 + q * 32 + l is ql[h * 64 + (q % 2) * 32 + l] nibble q // 2 with
    bits 2q..2q+1 of qh[h * 32 + l] on top, minus 32, times scale h * 8 + q * 2 + l // 16. The 6-bit values v
    become bytes v << 1 and f = 0.5 + v / 128, so a scale group's sum of (v - 32) * x is 128 * (F - 0.75 * X)."""
    pdl.wait_for_previous()
    rows, n_mask, m, x_rows, first, last = quant_bits.program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_bytes  # [BLOCK_N] bytes
    value = q6_k_block(
        x_rows,
        order_ptr,
        w_ptr,
        w16_ptr,
        row_start,
        n_mask,
        first,
        last,
        half_exponent,
        HAS_ORDER,
        BLOCK_N,
        PRMT,
        M_BLOCK,
    )
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


@triton.jit
def q6_k_rows(
    x_row,
    order_ptr,
    w_ptr,
    w16_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
):
    """[BLOCK_N] float32: `q6_k_block` for the one activation row at x_row."""
    x_rows = x_row + tl.zeros((1,), dtype=tl.int32)
    value = q6_k_block(
        x_rows, order_ptr, w_ptr, w16_ptr, row_start, n_mask, first, last, half_exponent, HAS_ORDER, BLOCK_N, PRMT, 1
    )
    return tl.sum(value, axis=0)


@triton.jit
def q6_k_block(
    x_rows,
    order_ptr,
    w_ptr,
    w16_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """[M_BLOCK, BLOCK_N] float32: the Q6_K rows starting at bytes `row_start` [BLOCK_N] (w_ptr bytes, w16_ptr the
    same memory as 16-bit words) times the activation rows at pointers `x_rows` [M_BLOCK], over super-blocks
    [first, last)."""
    x_at = x_rows[:, None, None, None]  # [M_BLOCK, 1, 1, 1]
    mask5 = n_mask[None, :, None, None, None]
    half = tl.arange(0, 2)[:, None, None]
    group = tl.arange(0, 2)[None, :, None]
    pair = group * 8 + tl.arange(0, 8)[None, None, :]  # [2, 2, 8]: 16-bit word p = g * 8 + p' of a half
    scale_slot = tl.arange(0, 2)[:, None] * 8 + tl.arange(0, 2)[None, :]  # [2, 2]: h * 8 + g
    acc = tl.zeros((M_BLOCK, BLOCK_N, 2, 2, 8), dtype=tl.float32)
    for step in range(first, last):
        block = row_start + step * 210  # [BLOCK_N] bytes
        half_words = (block // 2)[None, :, None, None, None]  # [1, BLOCK_N, 1, 1, 1]
        low0 = tl.load(w16_ptr + half_words + half * 32 + pair, mask=mask5, other=0).to(tl.int32)
        low1 = tl.load(w16_ptr + half_words + half * 32 + 16 + pair, mask=mask5, other=0).to(tl.int32)
        high = tl.load(w16_ptr + half_words + 64 + half * 16 + pair, mask=mask5, other=0).to(tl.int32)
        d = quant_bits.half_bits(tl.load(w16_ptr + block // 2 + 104, mask=n_mask, other=0).to(tl.int32)) * 128.0
        for q in tl.static_range(4):
            if q % 2 == 0:
                nibbles = ((low0 << 1) >> (4 * (q // 2))) & 0x1E1E
            else:
                nibbles = ((low1 << 1) >> (4 * (q // 2))) & 0x1E1E
            if q == 0:
                top = (high << 5) & 0x6060
            elif q == 1:
                top = (high << 3) & 0x6060
            elif q == 2:
                top = (high << 1) & 0x6060
            else:
                top = (high >> 1) & 0x6060
            six = nibbles | top  # [1, BLOCK_N, 2, 2, 8]: two bytes v << 1
            position = step * 256 + half * 128 + q * 32 + pair * 2
            x0 = quant_bits.activations_at(x_at, order_ptr, position, HAS_ORDER)  # [M_BLOCK, 2, 2, 8]
            x1 = quant_bits.activations_at(x_at, order_ptr, position + 1, HAS_ORDER)
            products = (
                quant_bits.byte_as_float(six, 0, half_exponent, PRMT) * x0[:, None]
                + quant_bits.byte_as_float(six, 1, half_exponent, PRMT) * x1[:, None]
            )  # [M_BLOCK, BLOCK_N, 2, 2, 8]
            scale_at = block[:, None, None] + 192 + scale_slot[None, :, :] + q * 2
            scale = tl.load(w_ptr + scale_at, mask=n_mask[:, None, None], other=0).to(tl.int8, bitcast=True)
            group_scale = (d[:, None, None] * scale.to(tl.float32))[None, :, :, :, None]  # [1, BLOCK_N, 2, 2, 1]
            # each thread keeps its own partial sums; they are added across the pairs once, at the end
            acc += group_scale * (products - 0.75 * (x0 + x1)[:, None])
    return tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)


@triton.jit
def q8_0_gemv_kernel(
    x_ptr,
    order_ptr,
    w16_ptr,
    part_ptr,
    arrivals_ptr,
    out_ptr,
    M,
    N,
    row_halves,
    stride_xm,
    stride_om,
    steps,
    steps_per_split,
    biased_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """Q8_0: 34-byte blocks of an fp16 d and 32 int8 quants, read as 16-bit words, eight blocks (256 values)
    per step. Byte b of word 1 + w of a block is value w * 2 + b. Quants q become bytes q + 128, each the float
    2**23 + q + 128 (`byte_as_biased_float`), from which one subtraction gives q exactly."""
    pdl.wait_for_previous()
    rows, n_mask, m, x_rows, first, last = quant_bits.program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_halves  # [BLOCK_N] 16-bit words
    value = q8_0_block(
        x_rows, order_ptr, w16_ptr, row_start, n_mask, first, last, biased_exponent, HAS_ORDER, BLOCK_N, PRMT, M_BLOCK
    )
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


@triton.jit
def q8_0_rows(
    x_row,
    order_ptr,
    w16_ptr,
    row_start,
    n_mask,
    first,
    last,
    biased_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
):
    """[BLOCK_N] float32: `q8_0_block` for the one activation row at x_row."""
    x_rows = x_row + tl.zeros((1,), dtype=tl.int32)
    value = q8_0_block(
        x_rows, order_ptr, w16_ptr, row_start, n_mask, first, last, biased_exponent, HAS_ORDER, BLOCK_N, PRMT, 1
    )
    return tl.sum(value, axis=0)


@triton.jit
def q8_0_block(
    x_rows,
    order_ptr,
    w16_ptr,
    row_start,
    n_mask,
    first,
    last,
    biased_exponent,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """[M_BLOCK, BLOCK_N] float32: the Q8_0 rows starting at 16-bit words `row_start` [BLOCK_N] times the
    activation rows at pointers `x_rows` [M_BLOCK], over super-blocks (eight blocks) [first, last)."""
    x_at = x_rows[:, None, None]  # [M_BLOCK, 1, 1]
    block_of_step = tl.arange(0, 8)
    blocks = block_of_step[:, None]
    word = tl.arange(0, 16)[None, :]
    acc = tl.zeros((M_BLOCK, BLOCK_N, 8, 16), dtype=tl.float32)
    for step in range(first, last):
        block = row_start[:, None] + step * 136 + block_of_step[None, :] * 17  # [BLOCK_N, 8]
        quants = tl.load(
            w16_ptr + block[None, :, :, None] + 1 + word[None, None], mask=n_mask[None, :, None, None], other=0
        )
        biased = quants.to(tl.int32) ^ 0x8080  # [1, BLOCK_N, 8, 16]: two bytes q + 128
        d = quant_bits.half_bits(tl.load(w16_ptr + block, mask=n_mask[:, None], other=0).to(tl.int32))  # [BLOCK_N, 8]
        position = step * 256 + blocks * 32 + word * 2
        q0 = quant_bits.byte_as_biased_float(biased, 0, biased_exponent, PRMT) - 8388736.0  # 2**23 + 128
        q1 = quant_bits.byte_as_biased_float(biased, 1, biased_exponent, PRMT) - 8388736.0
        products = (
            q0 * quant_bits.activations_at(x_at, order_ptr, position, HAS_ORDER)[:, None]
            + q1 * quant_bits.activations_at(x_at, order_ptr, position + 1, HAS_ORDER)[:, None]
        )  # [M_BLOCK, BLOCK_N, 8, 16]
        acc += d[None, :, :, None] * products  # each thread's partial sums, added across the words once, at the end
    return tl.sum(tl.sum(acc, axis=3), axis=2)
