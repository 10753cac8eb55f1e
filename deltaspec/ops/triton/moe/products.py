"""The device functions that several MoE kernels share: a GEMV of weight rows with one activation row on CUDA
cores (`rows_times_x`: the fused router's and the decode pairs' product), a float weight slab, a pair's token,
where an expert's weights start, the distinct experts of a decode pass, the SiLU product and the gated shared
expert's sum, each rounded as the reference (`deltaspec.ops.moe`) rounds.

The expert kernels take a weight operand `w` as the pair (stack, shared): the routed experts' weights (float [E,
rows, in] or GGUF blocks uint8 [E, rows, row_bytes]) and the shared expert's [rows, in] as expert E (the stack
itself, a placeholder, where it is not one); its strides per expert and per row (elements, bytes for blocks) come
with the kernel's other strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaspec.ops.triton import quant_gemv, quant_gemv_hf
from deltaspec.ops.triton.moe.tiles import PRMT


@triton.jit
def rows_times_x(
    x_row,
    w_ptr,
    rows,
    n_mask,
    row_stride,
    K,
    half_exponent,
    biased_exponent,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """[BLOCK_N] float32: weight rows `rows` (int32 [BLOCK_N]; n_mask the real ones) of one expert (at w_ptr;
    row_stride elements, or bytes for GGUF blocks) times the K activations at x_row, on CUDA cores: float rows in
    K_TILES = cdiv(K, BLOCK_K) slabs [BLOCK_N, BLOCK_K], GGUF rows (K a multiple of 256) with the decode GEMV's
    products (`quant_gemv`, which read `half_exponent` / `biased_exponent` as run-time values)."""
    if QTYPE < 0:
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * row_stride  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k_tile in tl.static_range(K_TILES):  # unrolled: every slab's load is issued before the first sum
            ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc += float_slab(w_rows, ks, n_mask, k_mask).to(tl.float32) * x[None, :]
        result = tl.sum(acc, axis=1)
    elif QTYPE == 1:
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        start = rows.to(tl.int64) * (row_stride // 4)
        result = quant_gemv.q4_k_rows(
            x_row, x_row, w32_ptr, start, n_mask, 0, K // 256, half_exponent, False, BLOCK_N, PRMT
        )
    elif QTYPE == 3:
        start = rows.to(tl.int64) * row_stride
        result = quant_gemv_hf.fp8_b128_rows(x_row, x_row, w_ptr, start, n_mask, 0, K // 256, False, BLOCK_N)
    elif QTYPE >= 4:  # I4_G32, I4_G128
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        start = rows.to(tl.int64) * (row_stride // 4)
        group: tl.constexpr = 32 if QTYPE == 4 else 128
        result = quant_gemv_hf.i4_rows(
            x_row, x_row, w32_ptr, start, n_mask, 0, K // 256, half_exponent, group, False, BLOCK_N, PRMT
        )
    elif QTYPE == 2:
        w16_ptr = w_ptr.to(tl.pointer_type(tl.int16))
        start = rows.to(tl.int64) * row_stride
        result = quant_gemv.q6_k_rows(
            x_row, x_row, w_ptr, w16_ptr, start, n_mask, 0, K // 256, half_exponent, False, BLOCK_N, PRMT
        )
    else:
        w16_ptr = w_ptr.to(tl.pointer_type(tl.int16))
        start = rows.to(tl.int64) * (row_stride // 2)
        result = quant_gemv.q8_0_rows(
            x_row, x_row, w16_ptr, start, n_mask, 0, K // 256, biased_exponent, False, BLOCK_N, PRMT
        )
    return result


@triton.jit
def float_slab(w_rows, ks, n_mask, k_mask):
    """w [BLOCK_N, BLOCK_K] of float weight rows `w_rows` (pointers [BLOCK_N, 1]) at columns ks [BLOCK_K]."""
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def token_of(pairs, routed_pairs, TOP_K: tl.constexpr):
    """The token of each pair: routed pair p is token p // TOP_K's slot p % TOP_K, shared pair routed_pairs + t
    is token t's."""
    return tl.where(pairs < routed_pairs, pairs // TOP_K, pairs - routed_pairs)


@triton.jit
def expert_weights(w, expert, E, stride_we, SHARED_W: tl.constexpr):
    """Where `expert`'s weights start in the weight operand `w` (see the module docstring; stride_we per expert):
    in the routed stack, or (with SHARED_W) the shared expert's for expert E."""
    stack, shared = w
    start = stack + expert.to(tl.int64) * stride_we
    if SHARED_W:
        if expert == E:
            start = shared
    return start


@triton.jit
def count_distinct(experts_ptr, num_pairs, reads_ptr, P_PAD: tl.constexpr):
    """reads[0] += the number of distinct held experts (not -1) among the pass's num_pairs <= P_PAD pairs
    (experts int32 [num_pairs], reads int64 [1])."""
    index = tl.arange(0, P_PAD)
    chosen = tl.load(experts_ptr + index, mask=index < num_pairs, other=-1)  # [P_PAD]
    earlier = (chosen[:, None] == chosen[None, :]) & (index[None, :] < index[:, None])  # [P_PAD, P_PAD]
    first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & (index < num_pairs) & (chosen >= 0)
    tl.atomic_add(reads_ptr, tl.sum(first.to(tl.int64), axis=0))


@triton.jit
def silu_product(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 products, each rounded to `dtype` as the reference's F.silu and product round."""
    gate = gate.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def plus_shared(total, shared, logit_ptr, token, stride_l, dtype: tl.constexpr):
    """total (float32 [BLOCK]) rounded to `dtype`, plus sigmoid(logit[token]) * shared (the shared expert's
    product [BLOCK], in `dtype`), rounded as the reference's `out + torch.sigmoid(logit) * shared_out` rounds;
    float32 out."""
    logit = tl.load(logit_ptr + token * stride_l).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
    return total.to(dtype).to(tl.float32) + (gate * shared.to(tl.float32)).to(dtype).to(tl.float32)
