"""`x @ weight.T` from GGUF blocks for a few input rows (decode, and the verify passes of speculative decoding), on
CUDA cores without tensor cores.

A program owns BLOCK_N weight rows, a block of M_BLOCK rows of x and a share of the input dimension, and walks it
one 256-value super-block at a time; each value it decodes is multiplied by the matching activations of all M_BLOCK
rows, so a pass of a few rows reads and decodes the weight once. Nothing is dequantized into a float
tile: each packed word is read once (16-byte vectors of 32-bit words where the layout is 4-byte aligned, 16-bit
words otherwise), the quants of four (or two) values at once are masked into the top bits of bytes, and each byte
becomes the float f = 0.5 + q / 2**s with one permute under a fixed exponent (`byte_as_float`), which is multiplied
by the matching activation and summed per sub-block. With F that sum and X the sum of the activations, the
sub-block's sum of q * x is 2**s * (F - X / 2) (the quants sit at the top of the byte so that F - X / 2 keeps most
bits); its scale is applied once to it, and a k-quant's min once to X (the algebra of `deltaspec.ops.quant.dequant`,
in float32, within a few float32 roundings of the float64 product). Q8_0's signed bytes become 2**23 + q + 128
instead (`byte_as_biased_float`), from which one subtraction gives q. `grid(0)` walks the row blocks of x fastest
(program t * row_blocks + b takes weight tile t and row block b), so the row blocks of a weight tile run side by
side and share its reads through L2; rows past the last of x repeat it and are not stored. Program `grid(1)` takes
super-blocks [s * steps_per_split, (s + 1) * steps_per_split) (the last share may be shorter); with several shares
the partial sums go to a float32 workspace [shares, M, N], and the last program of an output tile to finish adds
them in a fixed order (`store_or_add_shares`), so the result never depends on which share finished first. Each
kernel's product of BLOCK_N weight rows with M_BLOCK activation rows is a function (`q4_k_block`, `q6_k_block`,
`q8_0_block`, ...); its one-row form (`q4_k_rows`, `q6_k_rows`, `q8_0_rows`, ...) is what the mixture-of-experts
decode kernels call on one expert's rows. FP8_B128 blocks (an FP8 checkpoint's) turn each e4m3 byte into a float32
with two or three integer ops (`e4m3_scaled`; the hardware conversion's extra instructions per value cost 8-20 % of
the bandwidth on an H200). The int4 group blocks of W4A16 checkpoints (I4_G32, I4_G128: `i4_block`) take Q4_K's
nibble bytes, with each group's zero point folded into the activations' sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaspec.ops.triton import pdl

HALF_EXPONENT = 0x3F000000  # the top byte of a float32 in [0.5, 1), with the exponent's low bit 0
BIASED_EXPONENT = 0x4B000000  # the top byte of a float32 in [2**23, 2**24)


@triton.jit
def as_float(q):
    """Small non-negative integers (int32) as float32, exactly, without an int-to-float conversion."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def half_bits(bits):
    """The float16 whose bits are the low 16 bits of int32 `bits`, as float32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _prmt(word, magic, selector: tl.constexpr):
    """PTX `prmt.b32 d, word, magic, selector` elementwise (d's byte i is byte selector[4i:4i+4] of magic:word)."""
    if selector == 0x7044:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7044;"
    elif selector == 0x7144:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7144;"
    elif selector == 0x7244:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7244;"
    elif selector == 0x7344:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7344;"
    elif selector == 0x7650:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7650;"
    elif selector == 0x7651:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7651;"
    elif selector == 0x7652:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7652;"
    else:
        asm: tl.constexpr = "prmt.b32 $0, $1, $2, 0x7653;"
    return tl.inline_asm_elementwise(asm, "=r,r,r", [word, magic], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def byte_as_float(word, k: tl.constexpr, half_exponent, PRMT: tl.constexpr):
    """Byte k of each int32 of `word`, a byte v < 128, as the float32 0.5 + v / 256, exactly: the byte becomes bits
    16..23 under the byte `half_exponent` >> 24 (0x3F, see HALF_EXPONENT) with zero low bytes. On CUDA one
    `prmt` per value; the exponent comes in as a run-time argument so that it stays in one register and the
    selector is the immediate (a constant exponent becomes the immediate and pushes the selectors into
    registers, one move per value)."""
    magic = tl.zeros(word.shape, tl.int32) + half_exponent
    if PRMT:
        bits = _prmt(word, magic, 0x7044 + k * 0x100)
    else:
        bits = (((word >> (8 * k)) & 0xFF) << 16) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def byte_as_biased_float(word, k: tl.constexpr, biased_exponent, PRMT: tl.constexpr):
    """Byte k of each int32 of `word` as the float32 2**23 + byte: the byte under `biased_exponent`
    (BIASED_EXPONENT, a run-time argument for the reason `byte_as_float` gives)."""
    magic = tl.zeros(word.shape, tl.int32) + biased_exponent
    if PRMT:
        bits = _prmt(word, magic, 0x7650 + k)
    else:
        bits = ((word >> (8 * k)) & 0xFF) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_at(x_rows, order_ptr, positions, HAS_ORDER: tl.constexpr):
    """Activations [M_BLOCK, *positions.shape] (float32) of the x rows at pointers `x_rows` ([M_BLOCK, 1, ...], one
    dimension more than `positions`) at stored columns `positions` (gathered through the weight's input order)."""
    if HAS_ORDER:
        positions = tl.load(order_ptr + positions)
    return tl.load(x_rows + positions[None]).to(tl.float32)


@triton.jit
def _program_share(x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr):
    """This program's share of a GEMV launch: its weight rows [BLOCK_N] and their mask, its rows m [M_BLOCK] of x and
    their pointers (grid(0) is weight tile * row blocks + row block; rows past the last of x point at the last), and
    its input share (grid(1)) as the super-blocks [first, last)."""
    row_blocks = tl.cdiv(M, M_BLOCK)
    rows = (tl.program_id(0) // row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (tl.program_id(0) % row_blocks) * M_BLOCK + tl.arange(0, M_BLOCK)
    x_rows = x_ptr + tl.minimum(m, M - 1) * stride_xm
    first = tl.program_id(1) * steps_per_split
    return rows, rows < N, m, x_rows, first, tl.minimum(first + steps_per_split, steps)


@triton.jit
def store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, value, part_at, out_at, mask, tile, M, N):
    """A program's float32 result `value` (any shape; `part_at` its offsets in an [M, N] matrix, `out_at` in the
    output, `mask` which are real): straight into the output (in its dtype) when one share covers the whole
    input. Else into share grid(1)'s slice of the float32 workspace [shares, M, N]; the program then counts
    itself in arrivals[tile], and the last of the tile's shares to arrive sums the workspace over the shares in
    order s = 0, 1, ... (as a separate reduction kernel would), stores the output and sets the count back to 0
    for the next launch."""
    shares = tl.num_programs(1)
    if shares == 1:
        tl.store(out_ptr + out_at, value.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + tl.program_id(1) * M * N + part_at, value, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the arrival (the atomic releases them)
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        if arrived == shares - 1:
            total = tl.zeros(value.shape, dtype=tl.float32)
            for s in range(shares):
                total += tl.load(part_ptr + s * M * N + part_at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_at, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(arrivals_ptr + tile, 0)


@triton.jit
def _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om):
    """This program's result [M_BLOCK, BLOCK_N] for x rows m and weight rows `rows` (`store_or_add_shares`; its tile
    is grid(0))."""
    mask = (m < M)[:, None] & n_mask[None, :]
    part_at = m[:, None] * N + rows[None, :]
    out_at = m[:, None] * stride_om + rows[None, :]
    store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, value, part_at, out_at, mask, tl.program_id(0), M, N)


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
    rows, n_mask, m, x_rows, first, last = _program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_words  # [BLOCK_N] words
    value = q4_k_block(
        x_rows, order_ptr, w32_ptr, row_start, n_mask, first, last, half_exponent, HAS_ORDER, BLOCK_N, PRMT, M_BLOCK
    )
    _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


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
            xv = _x_at(x_at, order_ptr, step * 256 + column + k, HAS_ORDER)  # [M_BLOCK, 4, 8]
            f_low += byte_as_float(low, k, half_exponent, PRMT) * xv[:, None]
            x_low += xv
            xv = _x_at(x_at, order_ptr, step * 256 + column + 32 + k, HAS_ORDER)
            f_high += byte_as_float(high, k, half_exponent, PRMT) * xv[:, None]
            x_high += xv
        d = half_bits(head) * 32.0
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
        sums_low = tl.sum(x_low, axis=2)[:, None, :]  # [M_BLOCK, 1, 4]
        sums_high = tl.sum(x_high, axis=2)[:, None, :]
        scale_low = (d[:, None] * as_float((sc_word >> shift) & 0xFF))[None]  # [1, BLOCK_N, 4]
        scale_high = (d[:, None] * as_float((sc_word >> (shift + 8)) & 0xFF))[None]
        min_low = (dmin[:, None] * as_float((min_word >> shift) & 0xFF))[None]
        min_high = (dmin[:, None] * as_float((min_word >> (shift + 8)) & 0xFF))[None]
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
    rows, n_mask, m, x_rows, first, last = _program_share(
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
    _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


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
        d = half_bits(tl.load(w16_ptr + block // 2 + 104, mask=n_mask, other=0).to(tl.int32)) * 128.0
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
            x0 = _x_at(x_at, order_ptr, position, HAS_ORDER)  # [M_BLOCK, 2, 2, 8]
            x1 = _x_at(x_at, order_ptr, position + 1, HAS_ORDER)
            products = (
                byte_as_float(six, 0, half_exponent, PRMT) * x0[:, None]
                + byte_as_float(six, 1, half_exponent, PRMT) * x1[:, None]
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
    rows, n_mask, m, x_rows, first, last = _program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_halves  # [BLOCK_N] 16-bit words
    value = q8_0_block(
        x_rows, order_ptr, w16_ptr, row_start, n_mask, first, last, biased_exponent, HAS_ORDER, BLOCK_N, PRMT, M_BLOCK
    )
    _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


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
        d = half_bits(tl.load(w16_ptr + block, mask=n_mask[:, None], other=0).to(tl.int32))  # [BLOCK_N, 8]
        position = step * 256 + blocks * 32 + word * 2
        q0 = byte_as_biased_float(biased, 0, biased_exponent, PRMT) - 8388736.0  # 2**23 + 128
        q1 = byte_as_biased_float(biased, 1, biased_exponent, PRMT) - 8388736.0
        products = (
            q0 * _x_at(x_at, order_ptr, position, HAS_ORDER)[:, None]
            + q1 * _x_at(x_at, order_ptr, position + 1, HAS_ORDER)[:, None]
        )  # [M_BLOCK, BLOCK_N, 8, 16]
        acc += d[None, :, :, None] * products  # each thread's partial sums, added across the words once, at the end
    return tl.sum(tl.sum(acc, axis=3), axis=2)


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
    rows, n_mask, m, x_rows, first, last = _program_share(
        x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N, M_BLOCK
    )
    row_start = rows.to(tl.int64) * row_bytes  # [BLOCK_N] bytes
    value = fp8_b128_block(x_rows, order_ptr, w_ptr, row_start, n_mask, first, last, HAS_ORDER, BLOCK_N, M_BLOCK)
    _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


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
        x0 = _x_at(x_at, order_ptr, position, HAS_ORDER) * 1.152921504606847e18  # [M_BLOCK, 2, 32], times 2**60
        x1 = _x_at(x_at, order_ptr, position + 1, HAS_ORDER) * 1.152921504606847e18
        x2 = _x_at(x_at, order_ptr, position + 2, HAS_ORDER) * 1.152921504606847e18
        x3 = _x_at(x_at, order_ptr, position + 3, HAS_ORDER) * 1.152921504606847e18
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
    return tl.where(((header >> 24) & 0xFF) == 0, as_bfloat16, half_bits(header))


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
    rows, n_mask, m, x_rows, first, last = _program_share(
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
    _store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om)


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
            xv = _x_at(x_at, order_ptr, step * 256 + column + 2 * k, HAS_ORDER)  # [M_BLOCK, BLOCKS, WORDS]
            f += byte_as_float(even, k, half_exponent, PRMT) * xv[:, None]
            xs += xv
            xv = _x_at(x_at, order_ptr, step * 256 + column + 2 * k + 1, HAS_ORDER)
            f += byte_as_float(odd, k, half_exponent, PRMT) * xv[:, None]
            xs += xv
        scale = (int4_scale(header) * 32.0)[None, :, :, None]  # [1, BLOCK_N, BLOCKS, 1]
        offset = (0.5 + as_float((header >> 16) & 0xFF) * 0.03125)[None, :, :, None]  # 0.5 + z' / 32, exact
        acc += scale * (f - offset * xs[:, None])
    return tl.sum(tl.sum(acc, axis=3), axis=2)
