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

from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.moe.operands import Operands
from deltaspec.ops.triton.moe.products import (
    count_distinct,
    expert_weights,
    plus_shared,
    rows_times_x,
    silu_product,
    token_of,
)
from deltaspec.ops.triton.moe.tiles import PairTile, pairs_pad


@triton.heuristics({"K_TILES": lambda args: triton.cdiv(args["H"], args["BLOCK_K"])})
@triton.jit
def _pair_gate_up_kernel(
    x_ptr,
    w,
    experts_ptr,
    out_ptr,
    routed_pairs,
    E,
    H,
    inter_size,
    strides,
    exps,
    TOP_K: tl.constexpr,
    QTYPE: tl.constexpr,
    SHARED_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """out[pair, cols] = silu(gate) * up of pair `program_id(0)`'s token through its expert, for output columns
    `cols`: a GEMV per pair, no grouping. Grid (pairs, cdiv(inter_size, BLOCK_N)).

    x_ptr: float [N, H] activations; w: the gate|up weight operand (`products`), [E, 2I, H] float (QTYPE -1) or
    GGUF blocks, the shared expert's [2I, H] as expert E with SHARED_W (its pairs routed_pairs + token);
    experts_ptr: int32 [routed_pairs] the routing's experts (-1: another rank's, skipped); out_ptr: [pairs, I] in
    x's dtype (out); H, inter_size: the input values and I; strides: (stride_xm, stride_we, stride_wn, stride_om),
    x's rows, w's experts and rows (elements, bytes for blocks) and out's rows; exps: (half_exponent,
    biased_exponent), `quant_bits.HALF_EXPONENT` and `BIASED_EXPONENT` as run-time values; TOP_K: slots per token;
    K_TILES (heuristic): cdiv(H, BLOCK_K), the float slabs."""
    pdl.wait_for_previous()
    stride_xm, stride_we, stride_wn, stride_om = strides
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair, mask=pair < routed_pairs, other=E)
    if expert < 0:  # another rank's expert
        return
    x_row = x_ptr + token_of(pair, routed_pairs, TOP_K).to(tl.int64) * stride_xm
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < inter_size
    w_expert = expert_weights(w, expert, E, stride_we, SHARED_W)
    gate = rows_times_x(x_row, w_expert, cols, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES)
    up_rows = cols + inter_size
    up = rows_times_x(x_row, w_expert, up_rows, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES)
    product = silu_product(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N]
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, product, mask=n_mask)


@triton.heuristics(
    {
        "K_TILES": lambda args: triton.cdiv(args["inter_size"], args["BLOCK_K"]),
        "P_PAD": lambda args: pairs_pad(args["routed_pairs"]),
    }
)
@triton.jit
def _pair_down_sum_kernel(
    inter_ptr,
    w,
    experts_ptr,
    weights_ptr,
    shared,
    out_ptr,
    reads_ptr,
    routed_pairs,
    inter_size,
    H,
    strides,
    exps,
    TOP_K: tl.constexpr,
    QTYPE: tl.constexpr,
    SHARED: tl.constexpr,
    SHARED_W: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """out[token, cols] = the float32 sum over the token's slots, in slot order, of down_e(inter[pair])[cols] *
    weight[pair] (each rounded to the output dtype), rounded, plus the gated shared expert with SHARED: the
    down kernel and the sum kernel of the grouped path in one. The shared expert's product is shared[token]
    or, with SHARED_W, its down weights times inter[routed_pairs + token]. Program (0, 0) adds the number of
    distinct routed experts among the pass's pairs to reads[0]. Grid (cdiv(H, BLOCK_N), N).

    inter_ptr: the gated products [pairs, I]; w: the down weight operand (`products`), [E, H, I]; experts_ptr:
    int32 [routed_pairs], weights_ptr: float [routed_pairs], the routing; shared: (shared_ptr, logit_ptr), the
    shared expert's product [N, H] computed apart (a placeholder with SHARED_W or without SHARED) and its gate
    logits [N]; out_ptr: [N, H] (out), contiguous; reads_ptr: int64 [1]; strides: (stride_im, stride_we,
    stride_wn, stride_s, stride_l), inter's rows, w's experts and rows, shared's rows and the logits'; exps, TOP_K
    as `_pair_gate_up_kernel`'s; K_TILES, P_PAD (heuristics): cdiv(inter_size, BLOCK_K), and routed_pairs as a
    power of two (at least 16) for the count."""
    pdl.wait_for_previous()
    stack, shared_w_ptr = w
    shared_ptr, logit_ptr = shared
    stride_im, stride_we, stride_wn, stride_s, stride_l = strides
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < H
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(experts_ptr + pair)
        if expert >= 0:  # else another rank's expert, which adds nothing here
            x_row = inter_ptr + pair.to(tl.int64) * stride_im
            w_expert = stack + expert.to(tl.int64) * stride_we
            acc = rows_times_x(
                x_row, w_expert, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES
            )
            scale = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
            total += (acc.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    if SHARED:
        if SHARED_W:
            x_row = inter_ptr + (routed_pairs + token).to(tl.int64) * stride_im
            shared_row = rows_times_x(
                x_row, shared_w_ptr, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES
            ).to(dtype)
        else:
            shared_row = tl.load(shared_ptr + token * stride_s + cols, mask=n_mask, other=0.0)
        total = plus_shared(total, shared_row, logit_ptr, token, stride_l, dtype)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, total.to(dtype), mask=n_mask)
    if (tl.program_id(0) == 0) & (token == 0):
        count_distinct(experts_ptr, routed_pairs, reads_ptr, P_PAD)


def pair_products(ops: Operands, tile: PairTile) -> None:
    """ops.out = the experts' products of `expert_products`, one GEMV per pair: gate|up, then down with the sum."""
    tokens, top_k = ops.experts.shape
    num_pairs, inter_size = ops.inter.shape
    hidden = ops.x.shape[-1]
    launch = {"BLOCK_K": tile.block_k, "num_warps": tile.num_warps}
    launch |= {"exps": (quant_bits.HALF_EXPONENT, quant_bits.BIASED_EXPONENT)}
    w, (stride_we, stride_wn), flags = ops.weight_args(down=False)
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter_size, tile.gate_up_n))](
        ops.x,
        w=w,
        experts_ptr=ops.experts,
        out_ptr=ops.inter,
        routed_pairs=ops.routed_pairs,
        E=ops.num_experts,
        H=hidden,
        inter_size=inter_size,
        strides=(ops.x.stride(0), stride_we, stride_wn, ops.inter.stride(0)),
        TOP_K=top_k,
        BLOCK_N=tile.gate_up_n,
        **flags,
        **launch,
        **pdl.LAUNCH,
    )
    shared, (stride_s, stride_l) = ops.shared_operand(ops.shared_out)
    w, (stride_we, stride_wn), flags = ops.weight_args(down=True)
    _pair_down_sum_kernel[(triton.cdiv(hidden, tile.down_n), tokens)](
        ops.inter,
        w=w,
        experts_ptr=ops.experts,
        weights_ptr=ops.weights,
        shared=shared,
        out_ptr=ops.out,
        reads_ptr=ops.expert_reads,
        routed_pairs=ops.routed_pairs,
        inter_size=inter_size,
        H=hidden,
        strides=(ops.inter.stride(0), stride_we, stride_wn, stride_s, stride_l),
        TOP_K=top_k,
        SHARED=ops.shared_logit is not None,
        BLOCK_N=tile.down_n,
        **flags,
        **launch,
        **pdl.LAUNCH,
    )
