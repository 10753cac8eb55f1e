"""The decode pass's expert products for GGUF experts (up to `PAIR_MAX_TOKENS` tokens, a `PairTile`): no
grouping, a GEMV per (token, slot) pair reading the pair's expert from the routing, with SiLU and the gated
product in its epilogue (`_pair_gate_up_kernel`), then one kernel that takes a slab of a token's output columns
through all its slots' down products scaled by the routing weights and sums them in float32 in slot order, with
the gated shared expert (`_pair_down_sum_kernel`): two launches. Their products are the dense decode GEMV's
(`quant_gemv.q4_k_rows` and its siblings, through `products.rows_times_x`). Float experts take the same kernels
where a test or the sweep asks for a `PairTile`; `tile_for` gives them the ungrouped `Tile` of `grouped`."""

from __future__ import annotations

import triton
import triton.language as tl

from deltaspec.ops.triton import pdl, quant_gemv
from deltaspec.ops.triton.moe.operands import Operands
from deltaspec.ops.triton.moe.products import (
    count_distinct,
    expert_weights,
    plus_shared,
    rows_times_x,
    silu_product,
    token_of,
)
from deltaspec.ops.triton.moe.tiles import PRMT, PairTile, pairs_pad


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,
    w_ptr,
    shared_w_ptr,
    experts_ptr,
    out_ptr,
    routed_pairs,
    E,
    H,
    inter_size,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    half_exponent,
    biased_exponent,
    TOP_K: tl.constexpr,
    QTYPE: tl.constexpr,
    SHARED_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    PRMT: tl.constexpr,
):
    """out[pair, cols] = silu(gate) * up of pair `program_id(0)`'s token through its expert, for output columns
    `cols`: a GEMV per pair, no grouping (QTYPE, strides and the shared expert's pairs as `_gate_up_kernel`'s)."""
    pdl.wait_for_previous()
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair, mask=pair < routed_pairs, other=E)
    if expert < 0:  # another rank's expert
        return
    x_row = x_ptr + token_of(pair, routed_pairs, TOP_K).to(tl.int64) * stride_xm
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < inter_size
    w_expert = expert_weights(w_ptr, shared_w_ptr, expert, E, stride_we, SHARED_W)
    exps = (half_exponent, biased_exponent)
    gate = rows_times_x(x_row, w_expert, cols, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT)
    up_rows = cols + inter_size
    up = rows_times_x(x_row, w_expert, up_rows, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT)
    product = silu_product(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N]
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, product, mask=n_mask)


@triton.jit
def _pair_down_sum_kernel(
    inter_ptr,
    w_ptr,
    shared_w_ptr,
    experts_ptr,
    weights_ptr,
    shared_ptr,
    logit_ptr,
    out_ptr,
    reads_ptr,
    routed_pairs,
    inter_size,
    H,
    stride_im,
    stride_we,
    stride_wn,
    stride_s,
    stride_l,
    half_exponent,
    biased_exponent,
    TOP_K: tl.constexpr,
    QTYPE: tl.constexpr,
    SHARED: tl.constexpr,
    SHARED_W: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    PRMT: tl.constexpr,
):
    """out[token, cols] = the float32 sum over the token's slots, in slot order, of down_e(inter[pair])[cols] *
    weight[pair] (each rounded to the output dtype), rounded, plus the gated shared expert with SHARED: the
    down kernel and the sum kernel of the grouped path in one. The shared expert's product is shared[token]
    or, with SHARED_W, its down weights (at shared_w_ptr) times inter[routed_pairs + token]. Program (0, 0)
    adds the number of distinct routed experts among the pass's pairs to reads[0]."""
    pdl.wait_for_previous()
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < H
    dtype = out_ptr.dtype.element_ty
    exps = (half_exponent, biased_exponent)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(experts_ptr + pair)
        if expert >= 0:  # else another rank's expert, which adds nothing here
            x_row = inter_ptr + pair.to(tl.int64) * stride_im
            w_expert = w_ptr + expert.to(tl.int64) * stride_we
            acc = rows_times_x(
                x_row, w_expert, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT
            )
            scale = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
            total += (acc.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    if SHARED:
        if SHARED_W:
            x_row = inter_ptr + (routed_pairs + token).to(tl.int64) * stride_im
            shared = rows_times_x(
                x_row, shared_w_ptr, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT
            ).to(dtype)
        else:
            shared = tl.load(shared_ptr + token * stride_s + cols, mask=n_mask, other=0.0)
        total = plus_shared(total, shared, logit_ptr, token, stride_l, dtype)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, total.to(dtype), mask=n_mask)
    if (tl.program_id(0) == 0) & (token == 0):
        count_distinct(experts_ptr, routed_pairs, reads_ptr, P_PAD)


def pair_products(ops: Operands, tile: PairTile) -> None:
    """out = the experts' products of `expert_products`, one GEMV per pair: gate|up, then down with the sum."""
    tokens, top_k = ops.experts.shape
    num_pairs, inter_size = ops.inter.shape
    hidden = ops.x.shape[-1]
    launch = {"BLOCK_K": tile.block_k, "PRMT": PRMT, "num_warps": tile.num_warps}
    launch |= {"half_exponent": quant_gemv.HALF_EXPONENT, "biased_exponent": quant_gemv.BIASED_EXPONENT}
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter_size, tile.gate_up_n))](
        ops.x,
        experts_ptr=ops.experts,
        out_ptr=ops.inter,
        routed_pairs=ops.routed_pairs,
        E=ops.num_experts,
        H=hidden,
        inter_size=inter_size,
        stride_xm=ops.x.stride(0),
        stride_om=ops.inter.stride(0),
        TOP_K=top_k,
        BLOCK_N=tile.gate_up_n,
        K_TILES=triton.cdiv(hidden, tile.block_k),
        **ops.weight_args(down=False),
        **launch,
        **pdl.LAUNCH,
    )
    shared_out = ops.shared_out if ops.shared_out is not None else ops.out  # a placeholder when unused
    shared_logit = ops.shared_logit if ops.shared_logit is not None else ops.weights
    _pair_down_sum_kernel[(triton.cdiv(hidden, tile.down_n), tokens)](
        ops.inter,
        experts_ptr=ops.experts,
        weights_ptr=ops.weights,
        shared_ptr=shared_out,
        logit_ptr=shared_logit,
        out_ptr=ops.out,
        reads_ptr=ops.expert_reads,
        routed_pairs=ops.routed_pairs,
        inter_size=inter_size,
        H=hidden,
        stride_im=ops.inter.stride(0),
        stride_s=shared_out.stride(0),
        stride_l=shared_logit.stride(0),
        TOP_K=top_k,
        SHARED=ops.shared_logit is not None,
        P_PAD=pairs_pad(ops.routed_pairs),
        BLOCK_N=tile.down_n,
        K_TILES=triton.cdiv(inter_size, tile.block_k),
        **ops.weight_args(down=True),
        **launch,
        **pdl.LAUNCH,
    )
