"""The bit-level pieces the quantized products share (`quant_gemv`, `quant_gemv_hf`, `quant_matmul`,
`quant_dequant` and the MoE kernels): small integers and float16 halves read as float32 without conversion
instructions, a byte turned into a float with one permute under a fixed exponent (`byte_as_float`,
`byte_as_biased_float`), a GEMV program's share of a launch (`program_share`) and the sum of the shares in a fixed
order (`store_or_add_shares`, with the per-tile arrival counts it keeps: `arrival_counts`), so that a result never
depends on which share finished first.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter multiplies bf16 dot operands raw


@functools.cache
def arrival_counts(device: torch.device, count: int) -> torch.Tensor:
    """[count] int32 zeros: per output tile (or router row), how many of its programs have finished; the last to
    arrive sets its count back to 0 for the next launch (`quant_bits.store_or_add_shares`, the MoE router).
    Allocated at the first launch of that many tiles, an eager one (graph capture warms up first); launches on a
    device run one after another, as the engine's do, so they share it."""
    return torch.zeros(count, dtype=torch.int32, device=device)


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
def prmt(word, magic, selector: tl.constexpr):
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
        bits = prmt(word, magic, 0x7044 + k * 0x100)
    else:
        bits = (((word >> (8 * k)) & 0xFF) << 16) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def byte_as_biased_float(word, k: tl.constexpr, biased_exponent, PRMT: tl.constexpr):
    """Byte k of each int32 of `word` as the float32 2**23 + byte: the byte under `biased_exponent`
    (BIASED_EXPONENT, a run-time argument for the reason `byte_as_float` gives)."""
    magic = tl.zeros(word.shape, tl.int32) + biased_exponent
    if PRMT:
        bits = prmt(word, magic, 0x7650 + k)
    else:
        bits = ((word >> (8 * k)) & 0xFF) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def activations_at(x_rows, order_ptr, positions, HAS_ORDER: tl.constexpr):
    """Activations [M_BLOCK, *positions.shape] (float32) of the x rows at pointers `x_rows` ([M_BLOCK, 1, ...], one
    dimension more than `positions`) at stored columns `positions` (gathered through the weight's input order)."""
    if HAS_ORDER:
        positions = tl.load(order_ptr + positions)
    return tl.load(x_rows + positions[None]).to(tl.float32)


@triton.jit
def program_share(x_ptr, M, N, stride_xm, steps, steps_per_split, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr):
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
def store_rows(part_ptr, arrivals_ptr, out_ptr, value, m, rows, n_mask, M, N, stride_om):
    """This program's result [M_BLOCK, BLOCK_N] for x rows m and weight rows `rows` (`store_or_add_shares`; its tile
    is grid(0))."""
    mask = (m < M)[:, None] & n_mask[None, :]
    part_at = m[:, None] * N + rows[None, :]
    out_at = m[:, None] * stride_om + rows[None, :]
    store_or_add_shares(part_ptr, arrivals_ptr, out_ptr, value, part_at, out_at, mask, tl.program_id(0), M, N)
