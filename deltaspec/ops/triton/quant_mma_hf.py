"""The int4 product of 2 to 64 rows on tensor cores, from the file's own `I4_G128` blocks (`deltaspec.ops.quant.int4`:
a header word, then 16 nibble words whose byte b of word w holds values 8w + 2b and 8w + 2b + 1).

A program owns BLOCK_N output rows and a share of the input's groups. Per 128-value group it reads the 16 nibble
words of each row in one load; the nibbles q' go to the tensor cores as the exact 16-bit floats 0.5 + q' / 256
(low nibbles: the group's even values) and 0.5 + q' / 16 (high: its odd ones), as `quant_mma` feeds Q4_K
(`quant_mma.nibble_values`), each byte position against the 16 activation columns it pairs with, into two float32
sums P (even, odd), with the weights as the first operand (64-row wgmma on Hopper: 4.8 sm_90 instructions per
value in a 128-row tile against 5.7 the other way round and 14.0 in the block tile `quant_matmul` routes today,
`tools/quant_mma_sass.py`); products with ones give the activations' sums X over the group's even and odd columns, and
the group's value s * (q' - z') adds 256 s * P_even + 16 s * P_odd - s (128 + z') * X_even - s (8 + z') * X_odd
(four multiply-adds per output per group; float32 activations take q' itself: s * P - s * z' * X).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.quant_bits import INTERPRETED
from deltaspec.ops.triton.quant_gemv_hf import int4_scale
from deltaspec.ops.triton.quant_mma import VALUES_OF, dot_product, launch_shares, nibble_values, plus_dot_product


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
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    row_start = cols.to(tl.int64) * row_words
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    x_rows = x_ptr + m[:, None] * stride_xm  # [BLOCK_M, 1]
    word = tl.arange(0, 16)
    pair = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # the output transposed
    ones = tl.full((64, BLOCK_N), 1.0, tl.float32)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
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


def i4_mma(
    x: torch.Tensor,
    data: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """out [M, N] (row stride free) = x [M, in] (contiguous rows, in the stored columns' order) times the I4_G128
    blocks `data` [N, row_bytes] on tensor cores."""
    grid, shared = launch_shares(x, out, block_n, split_k)
    i4_mma_kernel[grid](
        x,
        data.view(torch.int32),
        *shared[:5],
        data.shape[1] // 4,
        *shared[5:],
        BLOCK_M=max(16, triton.next_power_of_2(out.shape[0])),
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        PRMT=not INTERPRETED,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
        VALUES=VALUES_OF[x.dtype],
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out
