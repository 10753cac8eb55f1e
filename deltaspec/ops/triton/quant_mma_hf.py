"""The int4, FP8 and Q8_0 products of 2 to 64 rows on tensor cores, from the blocks as loaded: `I4_G128`
(`deltaspec.ops.quant.int4`: a header word, then 16 nibble words whose byte b of word w holds values 8w + 2b and
8w + 2b + 1), `FP8_B128` (`deltaspec.ops.quant.fp8`: a float32 scale, then 32 words of e4m3 values, byte b of
word w value 4w + b) and GGUF's `Q8_0` (34 bytes: a float16 d, then 32 int8 values, read as 17 16-bit words).

A program owns BLOCK_N output rows and a share of the input's groups. Per 128-value group it reads the 16 nibble
words of each row in one load; the nibbles q' go to the tensor cores as the exact 16-bit floats 0.5 + q' / 256
(low nibbles: the group's even values) and 0.5 + q' / 16 (high: its odd ones), as `quant_mma` feeds Q4_K
(`quant_mma.nibble_values`), each byte position against the 16 activation columns it pairs with, into two float32
sums P (even, odd), with the weights as the first operand (64-row wgmma on Hopper: 4.8 sm_90 instructions per
value in a 128-row tile against 5.7 the other way round and 14.0 in the block tile `quant_matmul` routes today,
`tools/quant_mma_sass.py`); products with ones give the activations' sums X over the group's even and odd columns, and
the group's value s * (q' - z') adds 256 s * P_even + 16 s * P_odd - s (128 + z') * X_even - s (8 + z') * X_odd
(four multiply-adds per output per group; float32 activations take q' itself: s * P - s * z' * X).

FP8: per 128-value block, each byte position's e4m3 values go to the tensor cores as 16-bit floats by moving their
bits, exactly, subnormals included: as bfloat16 they are v * 2**-120 (the byte's sign to bit 15, its other seven
bits to bits 4..10: one permute per two words, a shift, two masks; `_e4m3_values`), multiplied by the activations
times 2**60 so that the products stay normal float32; as float16 (float16 activations) v * 2**-8. The four
products of a block add up in the tensor cores, and the block's scale times the two powers of two multiplies the
sum once: one multiply-add per output per 128 values.

Q8_0: per 32-value block, the int8 values of each 16-bit word's low and high byte become floats of the
activations' type (exact: |q| <= 128) for two products of 16 columns, and d multiplies their sum once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.quant_bits import INTERPRETED
from deltaspec.ops.triton.quant_gemv_hf import e4m3_scaled, int4_scale
from deltaspec.ops.triton.quant_mma import VALUES_OF, dot_product, launch_shares, nibble_values, plus_dot_product


@triton.jit
def _program(x_ptr, M, N, row_units, stride_xm, steps, steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's weight rows `cols` [BLOCK_N] (`n_mask`: those that exist; `row_start`: where each starts, in
    units of the kernel's words), activation rows m [BLOCK_M] (`m_mask`, `x_rows` their pointers [BLOCK_M, 1]) and
    its share of the 256-value steps [first, last), after the previous kernel (`pdl`)."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    return cols, cols < N, cols.to(tl.int64) * row_units, m, m < M, x_ptr + m[:, None] * stride_xm, first, last


@triton.jit
def i4_mma_kernel(
    x_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
    IEEE: tl.constexpr,
    VALUES: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the I4_G128 rows of w32 [N, row_words] on tensor cores."""
    cols, n_mask, row_start, m, m_mask, x_rows, first, last = _program(
        x_ptr, M, N, row_words, stride_xm, steps, steps_per_split, BLOCK_M, BLOCK_N
    )
    word = tl.arange(0, 16)
    pair = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # the output transposed
    ones = tl.full((64, BLOCK_N), 1.0, tl.float32)
    for group in tl.range(2 * first, 2 * last, num_stages=NUM_STAGES):
        block = row_start + group * 17  # [BLOCK_N] words: 17 a block, the header and 16 nibble words
        header = tl.load(w32_ptr + block, mask=n_mask, other=0)
        words = tl.load(w32_ptr + block[None, :] + 1 + word[:, None], mask=n_mask[None, :], other=0)  # [16, BLOCK_N]
        column = group * 128 + 8 * word  # [16]: value 0 of each word
        for b in tl.static_range(4):
            even, odd = nibble_values(words, b, VALUES, PRMT)  # values 8w + 2b and 8w + 2b + 1
            x_even = tl.load(x_rows + (column + 2 * b)[None, :], mask=m_mask[:, None], other=0)  # [BLOCK_M, 16]
            x_odd = tl.load(x_rows + (column + 2 * b + 1)[None, :], mask=m_mask[:, None], other=0)
            if b == 0:  # [BLOCK_N, BLOCK_M]: the weights are the first operand (Hopper's wgmma takes 64 rows of it)
                sums_even = dot_product(tl.trans(even), tl.trans(x_even), IEEE)
                sums_odd = dot_product(tl.trans(odd), tl.trans(x_odd), IEEE)
            else:
                sums_even = plus_dot_product(sums_even, tl.trans(even), tl.trans(x_even), IEEE)
                sums_odd = plus_dot_product(sums_odd, tl.trans(odd), tl.trans(x_odd), IEEE)
        x_all_even = tl.load(x_rows + (group * 128 + 2 * pair)[None, :], mask=m_mask[:, None], other=0)  # [BLOCK_M, 64]
        x_all_odd = tl.load(x_rows + (group * 128 + 2 * pair + 1)[None, :], mask=m_mask[:, None], other=0)
        scale = int4_scale(header)  # [BLOCK_N]
        zero = quant_bits.as_float((header >> 16) & 0xFF)
        if VALUES == "f32":
            acc = tl.fma(sums_even + sums_odd, scale[:, None], acc)
            offset_even = scale * zero
            offset_odd = offset_even
        else:
            acc = tl.fma(sums_even, (256.0 * scale)[:, None], acc)
            acc = tl.fma(sums_odd, (16.0 * scale)[:, None], acc)
            offset_even = scale * (128.0 + zero)
            offset_odd = scale * (8.0 + zero)
        acc = tl.fma(tl.trans(dot_product(x_all_even, ones, IEEE)), -offset_even[:, None], acc)
        acc = tl.fma(tl.trans(dot_product(x_all_odd, ones, IEEE)), -offset_odd[:, None], acc)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, tl.trans(acc), m, cols, n_mask, M, N, stride_om)


def _e4m3_asm(b: int, half: bool) -> tl.constexpr:
    """`_e4m3_values`' PTX for byte b of two words: their bytes b into the low bytes of t's halves with their signs
    copied into the high bytes, then each half's seven value bits moved to bfloat16's bits 4..10 (float16's 7..13)
    and the sign kept at bit 15."""
    select = f"prmt.b32 t, $1, $2, 0x{12 + b:X}{4 + b}{8 + b:X}{b};"
    shift, mask = ("7", "0x3F803F80") if half else ("4", "0x07F007F0")
    moved = f" shl.b32 a, t, {shift}; and.b32 a, a, {mask}; and.b32 t, t, 0x80008000; or.b32 $0, a, t;"
    return tl.constexpr("{.reg .b32 t, a; " + select + moved + "}")


_E4M3_BF16_0, _E4M3_BF16_1, _E4M3_BF16_2, _E4M3_BF16_3 = (_e4m3_asm(b, False) for b in range(4))
_E4M3_HALF_0, _E4M3_HALF_1, _E4M3_HALF_2, _E4M3_HALF_3 = (_e4m3_asm(b, True) for b in range(4))


@triton.jit
def _e4m3_values(words, b: tl.constexpr, VALUES: tl.constexpr, PRMT: tl.constexpr):
    """The e4m3 values v in byte b of each word, exactly: for float16 activations (VALUES "f16") v * 2**-8, else
    v * 2**-120; as 16-bit floats of the activations' type on CUDA, as float32 (`e4m3_scaled`) for float32
    activations or interpreted."""
    if VALUES == "f32" or not PRMT:
        values = e4m3_scaled(words, b)
        if VALUES == "f16":
            values = values * 5.192296858534828e33  # 2**112: v * 2**-8, as the float16 path has it
    else:
        if b == 0:
            bf16_asm: tl.constexpr = _E4M3_BF16_0
            f16_asm: tl.constexpr = _E4M3_HALF_0
        elif b == 1:
            bf16_asm: tl.constexpr = _E4M3_BF16_1
            f16_asm: tl.constexpr = _E4M3_HALF_1
        elif b == 2:
            bf16_asm: tl.constexpr = _E4M3_BF16_2
            f16_asm: tl.constexpr = _E4M3_HALF_2
        else:
            bf16_asm: tl.constexpr = _E4M3_BF16_3
            f16_asm: tl.constexpr = _E4M3_HALF_3
        if VALUES == "f16":
            values = tl.inline_asm_elementwise(f16_asm, "=r,r,r", [words], dtype=tl.float16, is_pure=True, pack=2)
        else:
            values = tl.inline_asm_elementwise(bf16_asm, "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)
    return values


@triton.jit
def fp8_mma_kernel(
    x_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRMT: tl.constexpr,
    IEEE: tl.constexpr,
    VALUES: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the FP8_B128 rows of w32 [N, row_words] on tensor cores."""
    cols, n_mask, row_start, m, m_mask, x_rows, first, last = _program(
        x_ptr, M, N, row_words, stride_xm, steps, steps_per_split, BLOCK_M, BLOCK_N
    )
    word = tl.arange(0, 32)
    if VALUES == "f16":
        x_scale: tl.constexpr = 1.0  # values v * 2**-8: products stay normal as they are
        undo: tl.constexpr = 256.0
    else:
        x_scale: tl.constexpr = 1.152921504606847e18  # 2**60, against the values' 2**-120
        undo: tl.constexpr = 1.152921504606847e18
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # the output transposed
    for block in tl.range(2 * first, 2 * last, num_stages=NUM_STAGES):
        at = row_start + block * 33  # [BLOCK_N] words: 33 a block, the scale and 32 words of values
        scale = tl.load(w32_ptr + at, mask=n_mask, other=0).to(tl.float32, bitcast=True)
        words = tl.load(w32_ptr + at[None, :] + 1 + word[:, None], mask=n_mask[None, :], other=0)  # [32, BLOCK_N]
        for b in tl.static_range(4):
            values = _e4m3_values(words, b, VALUES, PRMT)  # values 4w + b
            x = tl.load(x_rows + (block * 128 + 4 * word + b)[None, :], mask=m_mask[:, None], other=0)
            x = (x.to(tl.float32) * x_scale).to(x.dtype)  # exact: a power of two
            if b == 0:
                sums = dot_product(tl.trans(values), tl.trans(x), IEEE)
            else:
                sums = plus_dot_product(sums, tl.trans(values), tl.trans(x), IEEE)
        acc = tl.fma(sums, (scale * undo)[:, None], acc)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, tl.trans(acc), m, cols, n_mask, M, N, stride_om)


@triton.jit
def q8_0_mma_kernel(
    x_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the Q8_0 rows of w16 [N, row_halves] on tensor cores."""
    cols, n_mask, row_start, m, m_mask, x_rows, first, last = _program(
        x_ptr, M, N, row_halves, stride_xm, steps, steps_per_split, BLOCK_M, BLOCK_N
    )
    half = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # the output transposed
    for block in tl.range(8 * first, 8 * last, num_stages=NUM_STAGES):
        at = row_start + block * 17  # [BLOCK_N] 16-bit words: 17 a block, d and 16 words of two values each
        d = tl.load(w16_ptr + at, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        pairs = tl.load(w16_ptr + at[None, :] + 1 + half[:, None], mask=n_mask[None, :], other=0).to(tl.int32)
        x_even = tl.load(x_rows + (block * 32 + 2 * half)[None, :], mask=m_mask[:, None], other=0)  # [BLOCK_M, 16]
        x_odd = tl.load(x_rows + (block * 32 + 2 * half + 1)[None, :], mask=m_mask[:, None], other=0)
        low = ((pairs << 24) >> 24).to(tl.float32)  # value 2w, sign-extended: [16, BLOCK_N]
        high = (pairs >> 8).to(tl.float32)  # value 2w + 1
        sums = dot_product(tl.trans(low), tl.trans(x_even), IEEE)  # [BLOCK_N, BLOCK_M]
        sums = plus_dot_product(sums, tl.trans(high), tl.trans(x_odd), IEEE)
        acc = tl.fma(sums, d[:, None], acc)
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, tl.trans(acc), m, cols, n_mask, M, N, stride_om)


def i4_mma(x: torch.Tensor, data: torch.Tensor, out: torch.Tensor, **launch) -> torch.Tensor:
    """out [M, N] (row stride free) = x [M, in] (contiguous rows, in the stored columns' order) times the I4_G128
    blocks `data` [N, row_bytes] on tensor cores (`launch`: `_blocks_product`'s tile arguments)."""
    words = data.view(torch.int32)
    return _blocks_product(i4_mma_kernel, x, words, out, PRMT=not INTERPRETED, VALUES=VALUES_OF[x.dtype], **launch)


def fp8_mma(x: torch.Tensor, data: torch.Tensor, out: torch.Tensor, **launch) -> torch.Tensor:
    """The same for FP8_B128 blocks."""
    words = data.view(torch.int32)
    return _blocks_product(fp8_mma_kernel, x, words, out, PRMT=not INTERPRETED, VALUES=VALUES_OF[x.dtype], **launch)


def q8_0_mma(x: torch.Tensor, data: torch.Tensor, out: torch.Tensor, **launch) -> torch.Tensor:
    """The same for Q8_0 blocks."""
    return _blocks_product(q8_0_mma_kernel, x, data.view(torch.int16), out, **launch)


def _blocks_product(
    kernel,
    x: torch.Tensor,
    words: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    **constants,
) -> torch.Tensor:
    """Launch `kernel` over the blocks' rows `words` [N, words per row]: BLOCK_N rows a program, the input split
    in `split_k` shares (`quant_mma.launch_shares`)."""
    grid, shared = launch_shares(x, out, block_n, split_k)
    kernel[grid](
        x,
        words,
        *shared[:5],
        words.shape[1],
        *shared[5:],
        BLOCK_M=max(16, triton.next_power_of_2(out.shape[0])),
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
        num_warps=num_warps,
        **constants,
        **pdl.LAUNCH,
    )
    return out
