"""One pass from GGUF blocks to a float matrix on CUDA, for products of more rows than the block kernels take
(prefill chunks): each program reads BLOCK_N rows of one 256-value super-block once and writes their values in
the activations' dtype, dequantized in float32 exactly as `deltaspec.ops.quant.dequant` does (the same tile
code as the tensor-core products in `quant_matmul`), so cuBLAS then multiplies the same values the reference
would. Q8_0, Q4_K and Q6_K (the types of llama.cpp's Q4_K_M, Q6_K and Q8_0 files), FP8_B128 (an FP8
checkpoint's weights) and I4_G32 and I4_G128 (W4A16 checkpoints' int4 groups); other types keep the torch
reference. The tile code (`_tile`, `_q4_k_half_chunk`: a tile of rows dequantized in registers) lives here and the
tensor-core products of `quant_matmul` use it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops.quant import format_of
from deltaspec.ops.quant.dequant import dequantize as reference_dequantize
from deltaspec.ops.triton import pdl, quant_bits, quant_gemv_hf

KERNEL_TYPES = {"Q8_0": 0, "Q4_K": 1, "Q6_K": 2, "FP8_B128": 3, "I4_G32": 4, "I4_G128": 5}  # QTYPE of the tile code
STEP = 256  # values per super-block (eight Q8_0 blocks)
BLOCK_N = 16


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian float16 stored at byte pointer(s) `ptr`, as float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_N, 256] of super-block `step` of Q8_0, Q6_K, FP8_B128, I4_G32 or I4_G128 weight rows `rows`,
    dequantized in float32. Bytes are read in contiguous runs and unpacked with shifts and reshapes, never gathered
    value by value."""
    base = w_ptr + rows.to(tl.int64) * row_bytes  # [BLOCK_N]
    mask = n_mask[:, None]
    if QTYPE >= 4:  # I4_G32, I4_G128: rows and blocks start 4-aligned
        return _int4_tile(w_ptr, rows, row_bytes, step, n_mask, 32 if QTYPE == 4 else 128, BLOCK_N)
    elif QTYPE == 3:  # FP8_B128: 2 blocks of (float32 scale, 128 x e4m3); rows and blocks start 4-aligned
        block = base[:, None] + step * 264 + tl.arange(0, 2)[None, :] * 132  # [BLOCK_N, 2]
        scale = tl.load(block.to(tl.pointer_type(tl.int32)), mask=mask, other=0).to(tl.float32, bitcast=True)
        quants = tl.load(block[:, :, None] + 4 + tl.arange(0, 128)[None, None, :], mask=mask[:, :, None], other=0)
        values = scale[:, :, None] * quants.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, 2, 128]
        return tl.reshape(values, (BLOCK_N, 256))
    elif QTYPE == 0:  # Q8_0: 8 blocks of (fp16 d, 32 x int8)
        block = base[:, None] + step * 272 + tl.arange(0, 8)[None, :] * 34  # [BLOCK_N, 8]
        d = _fp16_at(block, mask)
        quants = tl.load(block[:, :, None] + 2 + tl.arange(0, 32)[None, None, :], mask=mask[:, :, None], other=0)
        values = d[:, :, None] * quants.to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, 8, 32]
        return tl.reshape(values, (BLOCK_N, 256))
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
def _int4_tile(w_ptr, rows, row_bytes, step, n_mask, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Values [BLOCK_N, 256] of step `step` of int4 rows of GROUP-value blocks (256 / GROUP blocks of a header
    word and GROUP / 8 nibble words per step; nibble k of word i is value 8i + k): scale * (q' - z') in float32."""
    BLOCKS: tl.constexpr = 256 // GROUP
    WORDS: tl.constexpr = GROUP // 8
    w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    group = tl.arange(0, BLOCKS)
    block = rows.to(tl.int64)[:, None] * (row_bytes // 4) + (step * BLOCKS + group[None, :]) * (WORDS + 1)
    header = tl.load(w32_ptr + block, mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCKS]
    words = block[:, :, None] + 1 + tl.arange(0, WORDS)[None, None, :]  # [BLOCK_N, BLOCKS, WORDS]
    quants = tl.load(w32_ptr + words, mask=n_mask[:, None, None], other=0)
    nibbles = (quants[:, :, :, None] >> (tl.arange(0, 8) * 4)[None, None, None, :]) & 0xF  # [N, BLOCKS, WORDS, 8]
    zero = (header >> 16) & 0xFF
    q = tl.reshape(nibbles, (BLOCK_N, BLOCKS, GROUP)) - zero[:, :, None]  # q' - z' in [-16, 15]
    values = quant_gemv_hf.int4_scale(header)[:, :, None] * q.to(tl.float32)  # [BLOCK_N, BLOCKS, GROUP]
    return tl.reshape(values, (BLOCK_N, 256))


@triton.jit
def _q4_k_sub_block(s0, s1, s2, j: tl.constexpr):
    """The 6-bit scale and min of sub-block j of Q4_K super-blocks whose 12 scale bytes are words s0, s1, s2."""
    if j < 4:
        return (s0 >> (8 * j)) & 63, (s1 >> (8 * j)) & 63
    scale = ((s2 >> (8 * (j - 4))) & 0xF) | (((s0 >> (8 * (j - 4) + 6)) & 3) << 4)
    low = ((s2 >> (8 * (j - 4) + 4)) & 0xF) | (((s1 >> (8 * (j - 4) + 6)) & 3) << 4)
    return scale, low


@triton.jit
def _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, j: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sub-block j's 32 values [BLOCK_N, 32] in float32 from its chunk's nibble words [BLOCK_N, 8] (low
    nibbles for even j, high for odd): value i * 4 + k is nibble (byte k of word i) * d * scale - dmin * min."""
    sc, mn = _q4_k_sub_block(s0, s1, s2, j)
    scale = d * quant_bits.as_float(sc)  # [BLOCK_N]
    low = dmin * quant_bits.as_float(mn)
    shifts = tl.arange(0, 4) * 8 + (j % 2) * 4
    q = quant_bits.as_float((quants[:, :, None] >> shifts[None, None, :]) & 0xF)  # [BLOCK_N, 8, 4]
    return tl.reshape(scale[:, None, None] * q - low[:, None, None], (BLOCK_N, 32))


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, row_bytes, stride_on, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[rows, step * 256 : (step + 1) * 256] for program (rows, step); QTYPE as in `quant_matmul`."""
    pdl.wait_for_previous()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1)
    n_mask = rows < N
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_on + step * 256
    if QTYPE == 1:  # Q4_K: 64-value chunks of two sub-blocks
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        block = rows.to(tl.int64) * (row_bytes // 4) + step * 36
        head = tl.load(w32_ptr + block, mask=n_mask, other=0)
        s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
        s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
        s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
        d = quant_bits.half_bits(head)
        dmin = quant_bits.half_bits(head >> 16)
        lane = tl.arange(0, 32)[None, :]
        for c in tl.static_range(4):
            quants = tl.load(
                w32_ptr + block[:, None] + 4 + c * 8 + tl.arange(0, 8)[None, :], mask=n_mask[:, None], other=0
            )  # [BLOCK_N, 8]
            low = _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, 2 * c, BLOCK_N)
            high = _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, 2 * c + 1, BLOCK_N)
            tl.store(out_rows + c * 64 + lane, low.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])
            tl.store(out_rows + c * 64 + 32 + lane, high.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])
    else:
        values = _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE, BLOCK_N)  # [BLOCK_N, 256] float32
        columns = tl.arange(0, 256)[None, :]
        tl.store(out_rows + columns, values.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def kernel_dequantizes(qtype: str, data: torch.Tensor) -> bool:
    """Whether the kernel takes this segment: a kernel type, 2-D, whole 256-value super-blocks per row (a row of
    Q8_0, FP8_B128, I4_G32 or I4_G128 blocks may end in part of one: such segments take the reference)."""
    fmt = format_of(qtype) if qtype in KERNEL_TYPES else None
    return fmt is not None and data.dim() == 2 and data.shape[1] % (fmt.type_size * STEP // fmt.block_size) == 0


def dequantize(data: torch.Tensor, qtype: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float matrix [rows, in] of one segment's blocks [rows, row_bytes], in `dtype` (written into `out`, a
    row-contiguous [rows, in] view, when given)."""
    rows, row_bytes = data.shape
    fmt = format_of(qtype)
    columns = row_bytes // fmt.type_size * fmt.block_size
    if out is None:
        out = torch.empty(rows, columns, device=data.device, dtype=dtype)
    if not kernel_dequantizes(qtype, data):
        return out.copy_(reference_dequantize(data, qtype))
    grid = (triton.cdiv(rows, BLOCK_N), columns // STEP)
    _dequantize_kernel[grid](
        data, out, rows, row_bytes, out.stride(0), QTYPE=KERNEL_TYPES[qtype], BLOCK_N=BLOCK_N, **pdl.LAUNCH
    )
    return out
