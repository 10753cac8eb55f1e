"""Q4_K products of 1 to 64 rows on tensor cores, from the blocks repacked at load time into the layout the
kernel reads (`repack_q4_k`): the nibbles as int32 words [in / 8, out] (word w of output row n holds values
8w .. 8w + 7 of that row, nibble i value 8w + i) and each super-block's four header words (d | dmin and the 12
bytes of 6-bit scales and mins) as [in / 256 * 4, out]. Both are contiguous along the output rows, so a program's
loads of BLOCK_N rows are whole 128-byte lines, and the repacking is a permutation of the file's bits
(`unpack_q4_k` gives the blocks back).

A program owns BLOCK_N output rows and a share of the super-blocks. Per 32-value sub-block it reads the four
nibble words of each row, and either dequantizes them in float32 exactly as `deltaspec.ops.quant.dequant` does
(d * scale * q - dmin * min, rounded to the activations' dtype) and multiplies by x on the tensor cores, or
(POST_SCALE) multiplies x by the bare quants 128 + q (exact in bfloat16; 1024 + q in float16) and scales the
sub-block's sums afterwards: scale * (P - B * X) - min * X with X the sum of the sub-block's activations. Shares
of the input are added in a fixed order (`quant_bits.store_or_add_shares`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.quant_dequant import _q4_k_sub_block

Q4_K_BLOCK = 144  # bytes per 256-value super-block


def repack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K rows [out, in / 256 * 144] (uint8) -> (nibble words [in / 8, out], header words [in / 256 * 4, out]),
    both int32, on the blocks' device."""
    rows = blocks.shape[0]
    supers = blocks.view(rows, -1, Q4_K_BLOCK)  # [out, S, 144]
    heads = supers[..., :16].contiguous().view(torch.int32)  # [out, S, 4]
    qs = supers[..., 16:].reshape(rows, -1, 4, 32).to(torch.int32)  # [out, S, chunk, byte]
    values = torch.stack((qs & 0xF, qs >> 4), dim=3)  # [out, S, chunk, half, byte]: value chunk * 64 + half * 32 + byte
    return _pack_fields(values.reshape(rows, -1, 8), 4), heads.permute(1, 2, 0).reshape(-1, rows).contiguous()


def unpack_q4_k(words: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """The Q4_K rows [out, in / 256 * 144] that `repack_q4_k` took apart."""
    rows = words.shape[1]
    values = _unpack_fields(words, 4, 8).reshape(rows, -1, 4, 2, 32)  # [out, S, chunk, half, byte]
    qs = (values[:, :, :, 0] | (values[:, :, :, 1] << 4)).to(torch.uint8).reshape(rows, -1, 128)
    head_bytes = heads.reshape(-1, 4, rows).permute(2, 0, 1).contiguous().view(torch.uint8)  # [out, S, 16]
    return torch.cat((head_bytes, qs), dim=-1).reshape(rows, -1)


Q6_K_BLOCK = 210


def repack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K rows [out, in / 256 * 210] (uint8) -> (low-nibble words [in / 8, out] int32 as `repack_q4_k`'s, words
    of the top two bits [in / 16, out] int32 (value 16w + i at bits 2i), the int8 scales [in / 16, out] and the
    float16 d [in / 256, out] as int16), on the blocks' device."""
    rows = blocks.shape[0]
    supers = blocks.view(rows, -1, Q6_K_BLOCK)  # [out, S, 210]
    ql = supers[..., :128].reshape(rows, -1, 2, 2, 32).to(torch.int32)  # [out, S, half, quarter % 2, l]
    qh = supers[..., 128:192].reshape(rows, -1, 2, 1, 32).to(torch.int32)  # [out, S, half, 1, l]
    low = torch.stack((ql & 0xF, ql >> 4), dim=3).reshape(rows, -1, 2, 4, 32)  # quarter q: nibble q // 2
    high = (qh >> (2 * torch.arange(4, device=blocks.device, dtype=torch.int32))[:, None]) & 3  # [out, S, 2, 4, 32]
    words = _pack_fields(low.reshape(rows, -1, 8), 4)
    high_words = _pack_fields(high.reshape(rows, -1, 16), 2)
    scales = supers[..., 192:208].reshape(rows, -1).t().contiguous().view(torch.int8)
    d = supers[..., 208:].contiguous().view(torch.int16).reshape(rows, -1).t().contiguous()
    return words, high_words, scales, d


def unpack_q6_k(words: torch.Tensor, high_words: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The Q6_K rows [out, in / 256 * 210] that `repack_q6_k` took apart."""
    rows = words.shape[1]
    low = _unpack_fields(words, 4, 8).reshape(rows, -1, 2, 2, 2, 32)  # [out, S, half, nibble, quarter % 2, l]
    high = _unpack_fields(high_words, 2, 16).reshape(rows, -1, 2, 4, 32)  # [out, S, half, quarter, l]
    ql = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, -1, 128)
    qh = (
        (high << (2 * torch.arange(4, device=words.device, dtype=torch.int32))[:, None])
        .sum(dim=3)
        .reshape(rows, -1, 64)
    )
    tail = torch.cat(
        (scales.view(torch.uint8).t().reshape(rows, -1, 16), d.t().contiguous().view(torch.uint8).reshape(rows, -1, 2)),
        dim=-1,
    )
    return torch.cat((ql.to(torch.uint8), qh.to(torch.uint8), tail), dim=-1).reshape(rows, -1)


def _pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[out, words, 32 / bits] small ints -> int32 words [words, out], field i at bits * i."""
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int32)
    words = (values << shifts).sum(dim=-1, dtype=torch.int64).to(torch.int32)  # bit 31 wraps to the int32's sign
    return words.t().contiguous()


def _unpack_fields(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """`_pack_fields` undone: int32 words [words, out] -> [out, words, count]."""
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    return (words.t()[..., None] >> shifts) & ((1 << bits) - 1)


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REPLICATED: tl.constexpr,
    POST_SCALE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the repacked Q4_K rows (module docstring); REPLICATED loads each
    nibble word once per value it holds (the cache serves the repeats) instead of once, unpacked by a reshape."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        head = heads_ptr + step * 4 * N + cols
        h0 = tl.load(head, mask=n_mask, other=0)
        s0 = tl.load(head + N, mask=n_mask, other=0)
        s1 = tl.load(head + 2 * N, mask=n_mask, other=0)
        s2 = tl.load(head + 3 * N, mask=n_mask, other=0)
        d = quant_bits.half_bits(h0)
        dmin = quant_bits.half_bits(h0 >> 16)
        for j in tl.static_range(8):
            sc, mn = _q4_k_sub_block(s0, s1, s2, j)
            scale = d * quant_bits.as_float(sc)  # [BLOCK_N]
            low = dmin * quant_bits.as_float(mn)
            if REPLICATED:
                words = tl.load(
                    words_ptr + (step * 32 + j * 4 + k // 8)[:, None] * N + cols[None, :],
                    mask=n_mask[None, :],
                    other=0,
                )  # [32, BLOCK_N]
                q = (words >> ((k % 8) * 4)[:, None]) & 0xF
            else:
                words = tl.load(
                    words_ptr + (step * 32 + j * 4 + tl.arange(0, 4))[:, None] * N + cols[None, :],
                    mask=n_mask[None, :],
                    other=0,
                )  # [4, BLOCK_N]
                q = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (32, BLOCK_N))
            x = tl.load(
                x_ptr + m[:, None] * stride_xm + (step * 256 + j * 32 + k)[None, :], mask=m_mask[:, None], other=0
            )
            if POST_SCALE:
                sums = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                if IEEE:
                    bias: tl.constexpr = 0.0
                    part = tl.dot(x.to(tl.float32), quant_bits.as_float(q), input_precision="ieee")
                elif x.dtype == tl.bfloat16:
                    bias: tl.constexpr = 128.0  # 0x4300 is bfloat16 128, whose last bit is worth 1
                    part = tl.dot(x, (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True))
                else:
                    bias: tl.constexpr = 1024.0  # float16 0x6400 = 1024
                    part = tl.dot(x, (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True))
                acc += scale[None, :] * (part - bias * sums[:, None]) - low[None, :] * sums[:, None]
            else:
                w = quant_bits.as_float(q) * scale[None, :] - low[None, :]  # [32, BLOCK_N]
                if IEEE:
                    acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
                else:
                    acc = tl.dot(x, w.to(x.dtype), acc)
    mask = m_mask[:, None] & n_mask[None, :]
    part_at = m[:, None] * N + cols[None, :]
    out_at = m[:, None] * stride_om + cols[None, :]
    quant_bits.store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, acc, part_at, out_at, mask, tl.program_id(0), M, N)


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
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """The same product on CUDA cores for a few rows (M <= M_BLOCK): per sub-block, the sum of q * x per row
    (the quants as float32, exactly) is scaled once, and the min is applied once to the sum of x."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, M_BLOCK)
    x_rows = x_ptr + tl.minimum(m, M - 1)[:, None, None] * stride_xm  # [M_BLOCK, 1, 1]
    place = tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [4, 8]: word i, nibble b -> value 8i + b
    shifts = tl.arange(0, 8)[None, :, None] * 4
    acc = tl.zeros((M_BLOCK, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        head = heads_ptr + step * 4 * N + cols
        h0 = tl.load(head, mask=n_mask, other=0)
        s0 = tl.load(head + N, mask=n_mask, other=0)
        s1 = tl.load(head + 2 * N, mask=n_mask, other=0)
        s2 = tl.load(head + 3 * N, mask=n_mask, other=0)
        d = quant_bits.half_bits(h0)
        dmin = quant_bits.half_bits(h0 >> 16)
        for j in tl.static_range(8):
            sc, mn = _q4_k_sub_block(s0, s1, s2, j)
            words = tl.load(
                words_ptr + (step * 32 + j * 4 + tl.arange(0, 4))[:, None] * N + cols[None, :],
                mask=n_mask[None, :],
                other=0,
            )  # [4, BLOCK_N]
            q = quant_bits.as_float((words[:, None, :] >> shifts) & 0xF)  # [4, 8, BLOCK_N]
            x = tl.load(x_rows + step * 256 + j * 32 + place[None]).to(tl.float32)  # [M_BLOCK, 4, 8]
            qx = tl.sum(tl.sum(q[None] * x[:, :, :, None], axis=1), axis=1)  # [M_BLOCK, BLOCK_N]
            xs = tl.sum(tl.sum(x, axis=2), axis=1)  # [M_BLOCK]
            acc += (d * quant_bits.as_float(sc))[None, :] * qx - (dmin * quant_bits.as_float(mn))[None, :] * xs[:, None]
    quant_bits.store_rows(part_ptr, arrivals_ptr, out_ptr, acc, m, cols, n_mask, M, N, stride_om)


def q4_k_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    heads: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """out [M, N] = x [M, in] times the repacked Q4_K matrix on CUDA cores, all M rows in one row block."""
    from deltaspec.ops.triton.quant_matmul import arrival_counts

    m, n = out.shape
    steps = x.shape[1] // 256
    per_share = triton.cdiv(steps, split_k)
    shares = triton.cdiv(steps, per_share)
    parts = torch.empty(shares, m, n, device=x.device, dtype=torch.float32) if shares > 1 else out
    grid = (triton.cdiv(n, block_n), shares)
    arrivals = arrival_counts(x.device, triton.next_power_of_2(grid[0]))
    q4_k_gemv_kernel[grid](
        x,
        words,
        heads,
        parts,
        arrivals,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        steps,
        per_share,
        BLOCK_N=block_n,
        M_BLOCK=triton.next_power_of_2(m),
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr,
):
    """out [M, N] = x [M, 256 * steps] times the repacked Q6_K rows (`repack_q6_k`): per 32-value sub-block, the
    6-bit values q of each row from its low-nibble and top-bit words, dequantized as d * scale * (q - 32) in
    float32 (the reference's arithmetic), rounded to x's dtype and multiplied on the tensor cores."""
    pdl.wait_for_previous()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(1) * steps_per_split
    for step in tl.range(first, tl.minimum(first + steps_per_split, steps), num_stages=NUM_STAGES):
        d = tl.load(d_ptr + step * N + cols, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        for j in tl.static_range(8):
            group = (step * 16 + j * 2 + k // 16)[:, None] * N + cols[None, :]  # [32, BLOCK_N]: 16-value groups
            low = tl.load(
                words_ptr + (step * 32 + j * 4 + k // 8)[:, None] * N + cols[None, :], mask=n_mask[None, :], other=0
            )
            high = tl.load(high_ptr + group, mask=n_mask[None, :], other=0)
            scale = tl.load(scales_ptr + group, mask=n_mask[None, :], other=0).to(tl.float32)
            q = ((low >> ((k % 8) * 4)[:, None]) & 0xF) | (((high >> ((k % 16) * 2)[:, None]) & 3) << 4)
            w = (d[None, :] * scale) * (q - 32).to(tl.float32)  # [32, BLOCK_N]
            x = tl.load(
                x_ptr + m[:, None] * stride_xm + (step * 256 + j * 32 + k)[None, :], mask=m_mask[:, None], other=0
            )
            if IEEE:
                acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
    mask = m_mask[:, None] & n_mask[None, :]
    part_at = m[:, None] * N + cols[None, :]
    out_at = m[:, None] * stride_om + cols[None, :]
    quant_bits.store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, acc, part_at, out_at, mask, tl.program_id(0), M, N)


def q6_k_mma(
    x: torch.Tensor,
    words: torch.Tensor,
    high_words: torch.Tensor,
    scales: torch.Tensor,
    d: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """out [M, N] (row stride free) = x [M, in] (contiguous rows) times the repacked Q6_K matrix."""
    from deltaspec.ops.triton.quant_matmul import INTERPRETED, arrival_counts

    m, n = out.shape
    steps = x.shape[1] // 256
    per_share = triton.cdiv(steps, split_k)
    shares = triton.cdiv(steps, per_share)
    parts = torch.empty(shares, m, n, device=x.device, dtype=torch.float32) if shares > 1 else out
    grid = (triton.cdiv(n, block_n), shares)
    arrivals = arrival_counts(x.device, triton.next_power_of_2(grid[0]))
    q6_k_mma_kernel[grid](
        x,
        words,
        high_words,
        scales,
        d,
        parts,
        arrivals,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        steps,
        per_share,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out


def q4_k_mma(
    x: torch.Tensor,
    words: torch.Tensor,
    heads: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    replicated: bool = True,
    post_scale: bool = False,
) -> torch.Tensor:
    """out [M, N] (row stride free) = x [M, in] (contiguous rows) times the repacked Q4_K matrix."""
    from deltaspec.ops.triton.quant_matmul import INTERPRETED, arrival_counts

    m, n = out.shape
    steps = x.shape[1] // 256
    per_share = triton.cdiv(steps, split_k)
    shares = triton.cdiv(steps, per_share)
    parts = torch.empty(shares, m, n, device=x.device, dtype=torch.float32) if shares > 1 else out
    grid = (triton.cdiv(n, block_n), shares)
    arrivals = arrival_counts(x.device, triton.next_power_of_2(grid[0]))
    q4_k_mma_kernel[grid](
        x,
        words,
        heads,
        parts,
        arrivals,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        steps,
        per_share,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        REPLICATED=replicated,
        POST_SCALE=post_scale,
        NUM_STAGES=num_stages,
        IEEE=x.dtype == torch.float32 or INTERPRETED,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out
