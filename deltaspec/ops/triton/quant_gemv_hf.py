"""`x @ weight.T` for a few input rows from the block formats deltaspec packs from Hugging Face checkpoints, with
the design of the GGUF GEMVs (`quant_gemv`: a program's weight rows, row block and input share; the shares summed
in a fixed order). FP8_B128 blocks (an FP8 block-scaled checkpoint's) turn each e4m3 byte into a float32 with two
or three integer ops (`e4m3_scaled`; the hardware conversion's extra instructions per value cost 8-20 % of the
bandwidth on an H200). The int4 group blocks of W4A16 checkpoints (I4_G32, I4_G128: `i4_block`) take Q4_K's nibble
bytes, with each group's zero point folded into the activations' sum. The one-row forms (`fp8_b128_rows`,
`i4_rows`) are what the mixture-of-experts decode kernels call on one expert's rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_bits


@triton.jit
def fp32_at(w32_ptr, word, mask):
    """The float32 stored as 32-bit word(s) `word` of w32_ptr (0 where masked)."""
    return tl.load(w32_ptr + word, mask=mask, other=0).to(tl.float32, bitcast=True)


@triton.jit
def fp8_b128_gemv_kernel(
    x_ptr,
    order_ptr,
    w_ptr,
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
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """FP8_B128: 132-byte blocks of a float32 scale and 128 e4m3 values, two blocks (256 values) per step."""
    pdl.wait_for_previous()
    rows, n_mask, m, x_rows, first, last = quant_bits.program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_bytes  # [BLOCK_N] bytes
    value = fp8_b128_block(x_rows, order_ptr, w_ptr, row_start, n_mask, first, last, HAS_ORDER, BLOCK_N, M_BLOCK)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


@triton.jit
def e4m3_scaled(word, k: tl.constexpr):
    """Byte k of each int32 of `word`, an e4m3 value v, as the float32 v * 2**-120, exactly, in integer ops: the
    byte shifted to the top (bits 24..31), shifted down 4 with its sign copied (bit 31 stays the sign, the
    exponent and mantissa land in bits 20..26, where they are a float32's low exponent bits and top mantissa
    bits) and masked to those bits. An e4m3 subnormal becomes a float32 subnormal with the same factor."""
    top = word if k == 3 else word << (24 - 8 * k)
    return ((top >> 4) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000


@triton.jit
def fp8_b128_rows(
    x_row, order_ptr, w_ptr, row_start, n_mask, first, last, HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr
):
    """[BLOCK_N] float32: `fp8_b128_block` for the one activation row at x_row."""
    x_rows = x_row + tl.zeros((1,), dtype=tl.int32)
    value = fp8_b128_block(x_rows, order_ptr, w_ptr, row_start, n_mask, first, last, HAS_ORDER, BLOCK_N, 1)
    return tl.sum(value, axis=0)


@triton.jit
def fp8_b128_block(
    x_rows,
    order_ptr,
    w_ptr,
    row_start,
    n_mask,
    first,
    last,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """[M_BLOCK, BLOCK_N] float32: the FP8_B128 rows starting at bytes `row_start` [BLOCK_N] times the activation
    rows at pointers `x_rows` [M_BLOCK], over steps (two blocks) [first, last). The values are read as 32-bit
    words (a block's are 4-byte aligned), each byte turned into the float32 v * 2**-120 by integer ops
    (`e4m3_scaled`: no conversion instructions) and multiplied by its activation times 2**60; a word's four
    products are summed, then scaled by the block's scale times 2**60, so every intermediate stays a normal
    float32 for weights and activations of ordinary size."""
    x_at = x_rows[:, None, None]  # [M_BLOCK, 1, 1]
    w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    half = tl.arange(0, 2)
    word = tl.arange(0, 32)
    start = row_start // 4  # [BLOCK_N] words
    acc = tl.zeros((M_BLOCK, BLOCK_N, 2, 32), dtype=tl.float32)
    for step in range(first, last):
        block = start[:, None] + step * 66 + half[None, :] * 33  # [BLOCK_N, 2] words
        scale = fp32_at(w32_ptr, block, n_mask[:, None])  # [BLOCK_N, 2]
        words = tl.load(
            w32_ptr + block[None, :, :, None] + 1 + word[None, None, None, :], mask=n_mask[None, :, None, None], other=0
        )  # [1, BLOCK_N, 2, 32]
        position = step * 256 + half[:, None] * 128 + word[None, :] * 4  # [2, 32]: value 0 of each word
        x0 = (
            quant_bits.activations_at(x_at, order_ptr, position, HAS_ORDER) * 1.152921504606847e18
        )  # [M_BLOCK, 2, 32], times 2**60
        x1 = quant_bits.activations_at(x_at, order_ptr, position + 1, HAS_ORDER) * 1.152921504606847e18
        x2 = quant_bits.activations_at(x_at, order_ptr, position + 2, HAS_ORDER) * 1.152921504606847e18
        x3 = quant_bits.activations_at(x_at, order_ptr, position + 3, HAS_ORDER) * 1.152921504606847e18
        products = (
            e4m3_scaled(words, 0) * x0[:, None]
            + e4m3_scaled(words, 1) * x1[:, None]
            + e4m3_scaled(words, 2) * x2[:, None]
            + e4m3_scaled(words, 3) * x3[:, None]
        )  # [M_BLOCK, BLOCK_N, 2, 32]
        acc += products * (scale * 1.152921504606847e18)[None, :, :, None]
    return tl.sum(tl.sum(acc, axis=3), axis=2)


@triton.jit
def int4_scale(header):
    """The float32 scale of int4 group blocks (`I4_G32`, `I4_G128`) from their header words (int32): the low 16
    bits as a bfloat16 where the type byte (bits 24..31) is 0, else as a float16."""
    as_bfloat16 = (header << 16).to(tl.float32, bitcast=True)
    return tl.where(((header >> 24) & 0xFF) == 0, as_bfloat16, quant_bits.half_bits(header))


@triton.jit
def i4_gemv_kernel(
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
    GROUP: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """I4_G32 / I4_G128 (GROUP 32 or 128): blocks of a header word (scale bits, zero point z', scale type) and
    GROUP / 8 nibble words, 256 / GROUP blocks per step. Nibble k of nibble word i holds value 8i + k. Nibbles q'
    become bytes q' << 3 and f = 0.5 + q' / 32 (even values from the word shifted left 3, odd ones shifted right
    1), so a word's sum of (q' - z') * x is 32 * (F - (0.5 + z' / 32) * X)."""
    pdl.wait_for_previous()
    rows, n_mask, m, x_rows, first, last = quant_bits.program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_words  # [BLOCK_N] words
    value = i4_block(
        x_rows,
        order_ptr,
        w32_ptr,
        row_start,
        n_mask,
        first,
        last,
        half_exponent,
        GROUP,
        HAS_ORDER,
        BLOCK_N,
        PRMT,
        M_BLOCK,
    )
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


@triton.jit
def i4_rows(
    x_row,
    order_ptr,
    w32_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    GROUP: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
):
    """[BLOCK_N] float32: `i4_block` for the one activation row at x_row."""
    x_rows = x_row + tl.zeros((1,), dtype=tl.int32)
    value = i4_block(
        x_rows, order_ptr, w32_ptr, row_start, n_mask, first, last, half_exponent, GROUP, HAS_ORDER, BLOCK_N, PRMT, 1
    )
    return tl.sum(value, axis=0)


@triton.jit
def i4_block(
    x_rows,
    order_ptr,
    w32_ptr,
    row_start,
    n_mask,
    first,
    last,
    half_exponent,
    GROUP: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRMT: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """[M_BLOCK, BLOCK_N] float32: the int4 rows of GROUP-value blocks starting at words `row_start` [BLOCK_N]
    times the activation rows at pointers `x_rows` [M_BLOCK], over steps (256 values) [first, last) (the layout
    and algebra of `i4_gemv_kernel`). Each thread keeps its words' partial sums, the group's scale and zero point
    applied once per word of eight values; they are added across the row once, at the end."""
    BLOCKS: tl.constexpr = 256 // GROUP
    WORDS: tl.constexpr = GROUP // 8  # nibble words per block, after its header word
    x_at = x_rows[:, None, None]  # [M_BLOCK, 1, 1]
    group = tl.arange(0, BLOCKS)
    word = group[:, None] * (WORDS + 1) + 1 + tl.arange(0, WORDS)[None, :]  # [BLOCKS, WORDS]: block b, word i
    column = group[:, None] * GROUP + tl.arange(0, WORDS)[None, :] * 8  # [BLOCKS, WORDS]: value of nibble 0
    acc = tl.zeros((M_BLOCK, BLOCK_N, BLOCKS, WORDS), dtype=tl.float32)
    for step in range(first, last):
        block = row_start + step * (BLOCKS * (WORDS + 1))  # [BLOCK_N] words
        quants = tl.load(
            w32_ptr + block[None, :, None, None] + word[None, None], mask=n_mask[None, :, None, None], other=0
        )  # [1, BLOCK_N, BLOCKS, WORDS]
        header = tl.load(w32_ptr + block[:, None] + group[None, :] * (WORDS + 1), mask=n_mask[:, None], other=0)
        even = (quants << 3) & 0x78787878  # [1, BLOCK_N, BLOCKS, WORDS]: byte k is q' << 3 of value 8i + 2k
        odd = (quants >> 1) & 0x78787878  # value 8i + 2k + 1
        f = tl.zeros((M_BLOCK, BLOCK_N, BLOCKS, WORDS), dtype=tl.float32)
        xs = tl.zeros((M_BLOCK, BLOCKS, WORDS), dtype=tl.float32)
        for k in tl.static_range(4):
            xv = quant_bits.activations_at(
                x_at, order_ptr, step * 256 + column + 2 * k, HAS_ORDER
            )  # [M_BLOCK, BLOCKS, WORDS]
            f += quant_bits.byte_as_float(even, k, half_exponent, PRMT) * xv[:, None]
            xs += xv
            xv = quant_bits.activations_at(x_at, order_ptr, step * 256 + column + 2 * k + 1, HAS_ORDER)
            f += quant_bits.byte_as_float(odd, k, half_exponent, PRMT) * xv[:, None]
            xs += xv
        scale = (int4_scale(header) * 32.0)[None, :, :, None]  # [1, BLOCK_N, BLOCKS, 1]
        offset = (0.5 + quant_bits.as_float((header >> 16) & 0xFF) * 0.03125)[None, :, :, None]  # 0.5 + z' / 32, exact
        acc += scale * (f - offset * xs[:, None])
    return tl.sum(tl.sum(acc, axis=3), axis=2)
