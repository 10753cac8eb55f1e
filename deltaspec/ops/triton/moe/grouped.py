"""The grouped expert products (verify passes, batches, prefill; float experts' decode passes too): the pairs
grouped by expert into blocks of a `Tile`'s height (`grouping`, or one pair per block where the tile is
`ungrouped`, the routing itself then being the block table), one launch for every selected expert's gate|up
product with SiLU (`_gate_up_kernel`), one for the down products scaled by the routing weights (`_down_kernel`),
and one that sums a token's top-k outputs in float32 in slot order with the gated shared expert (`_sum_kernel`;
summing in the down kernel's epilogue would need atomics, whose order varies from run to run). A program takes
one block of one expert's pairs and a slab of output columns, so each selected expert's weights are read once per
pass, and blocks past the last used one return at once. The product puts the expert's output columns on the
MMA's wide side and the pairs on its narrow side (padded to 16); GGUF blocks are dequantized in registers with the
tile code of `quant_dequant` exactly as the reference dequantizes them.

The kernels read the block table as two operands: `blocks` = (pairs_ptr, block_experts_ptr), each block's pairs
int32 [blocks * BLOCK_M] (num_pairs past the last) and expert int32 [blocks] (-1: unused), or with UNGROUPED
the routing's experts int32 [routed_pairs] (block b is pair b); `counts` = (num_pairs, routed_pairs, E), the
pass's pairs (the routed ones, then with a shared expert as expert E one per token), the routed ones, and the
routed experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops import moe as reference
from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.moe.grouping import group_by_expert
from deltaspec.ops.triton.moe.operands import Operands
from deltaspec.ops.triton.moe.products import (
    count_distinct,
    expert_weights,
    float_slab,
    plus_shared,
    silu_product,
    token_of,
)
from deltaspec.ops.triton.moe.tiles import SUM_BLOCK, Tile, pairs_pad, widen
from deltaspec.ops.triton.quant_dequant import _q4_k_half_chunk, _tile


@triton.jit
def _times_rows(w, x, acc, WIDEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, K] @ x [BLOCK_M, K].T, w rounded to x's dtype first."""
    if WIDEN:  # float32 products (no TF32): float32 activations, or Triton's interpreter
        return tl.dot(w.to(x.dtype).to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w.to(x.dtype), tl.trans(x), acc)


@triton.jit
def _quant_rows_times(
    x_rows,
    row_mask,
    w_ptr,
    rows,
    n_mask,
    row_bytes,
    K,
    acc,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] += (GGUF rows `rows` of w_ptr, dequantized) @ x_rows.T over all K input values;
    x_rows: pointers [BLOCK_M, 1] to the activation rows, row_mask [BLOCK_M] the real ones; rows, n_mask
    [BLOCK_N]; row_bytes: the weight's row stride."""
    lane = tl.arange(0, 32)
    if QTYPE == 1:  # Q4_K, read as int32 words: each row's start, once
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        row_words = rows.to(tl.int64) * (row_bytes // 4)  # [BLOCK_N]
    for step in range(0, K // 256):
        if QTYPE == 1:  # Q4_K: one 64-value chunk (two sub-blocks) at a time
            block = row_words + step * 36
            head = tl.load(w32_ptr + block, mask=n_mask, other=0)
            s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
            s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
            s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
            d = quant_bits.half_bits(head)
            dmin = quant_bits.half_bits(head >> 16)
            for c in tl.static_range(4):
                quants = tl.load(
                    w32_ptr + block[:, None] + 4 + c * 8 + tl.arange(0, 8)[None, :], mask=n_mask[:, None], other=0
                )  # [BLOCK_N, 8]
                for half in tl.static_range(2):
                    w = _q4_k_half_chunk(quants, d, dmin, s0, s1, s2, 2 * c + half, BLOCK_N)  # [BLOCK_N, 32]
                    x = tl.load(x_rows + step * 256 + c * 64 + half * 32 + lane[None, :], mask=row_mask[:, None])
                    acc = _times_rows(w, x, acc, WIDEN)
        else:  # Q8_0, Q6_K, FP8_B128, I4_G32, I4_G128: one 256-value super-block at a time
            w = _tile(w_ptr, rows, row_bytes, step, n_mask, QTYPE, BLOCK_N)  # [BLOCK_N, 256] float32
            x = tl.load(x_rows + step * 256 + tl.arange(0, 256)[None, :], mask=row_mask[:, None])
            acc = _times_rows(w, x, acc, WIDEN)
    return acc


@triton.jit
def _block(blocks, counts, BLOCK_M: tl.constexpr, UNGROUPED: tl.constexpr):
    """(expert, pairs [BLOCK_M]) of block `program_id(0)` of the block table (see the module docstring)."""
    pairs_ptr, block_experts_ptr = blocks
    num_pairs, routed_pairs, E = counts
    block = tl.program_id(0)
    if UNGROUPED:
        expert = tl.load(block_experts_ptr + block, mask=block < routed_pairs, other=E)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_pairs)
    else:
        expert = tl.load(block_experts_ptr + block)
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.heuristics({"WIDEN": lambda args: widen(args["x_ptr"].dtype)})
@triton.jit
def _gate_up_kernel(
    x_ptr,
    w,
    blocks,
    out_ptr,
    counts,
    H,
    inter_size,
    strides,
    TOP_K: tl.constexpr,
    QTYPE: tl.constexpr,
    SHARED_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
    UNGROUPED: tl.constexpr,
):
    """out[pair, cols] = silu(gate) * up of the block's pairs' tokens, for output columns `cols` of the block's
    expert. Grid (blocks, cdiv(inter_size, BLOCK_N)).

    x_ptr: float [N, H] activations; w: the gate|up weight operand (`products`), float [E, 2I, H] (QTYPE -1) or GGUF
    blocks (QTYPE of `quant_dequant.KERNEL_TYPES`), the shared expert's [2I, H] as expert E with SHARED_W; blocks,
    counts: the block table (module docstring); out_ptr: [num_pairs, I] in x's dtype (out); H, inter_size: the
    input values and I; strides: (stride_xm, stride_we, stride_wn, stride_om), x's rows, w's experts and rows
    (elements, bytes for blocks) and out's rows; TOP_K: slots per token; BLOCK_M, BLOCK_N, BLOCK_K, UNGROUPED: the
    `Tile`; WIDEN (heuristic): float32 products."""
    pdl.wait_for_previous()
    stride_xm, stride_we, stride_wn, stride_om = strides
    num_pairs, routed_pairs, E = counts
    expert, pairs = _block(blocks, counts, BLOCK_M, UNGROUPED)
    if expert < 0:
        return
    valid = pairs < num_pairs  # [BLOCK_M]
    tokens = tl.where(valid, token_of(pairs, routed_pairs, TOP_K), 0)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < inter_size
    w_expert = expert_weights(w, expert, E, stride_we, SHARED_W)
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if QTYPE < 0:
        gate_rows = w_expert + cols.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + inter_size * stride_wn
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < H
            x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            gate = _times_rows(float_slab(gate_rows, ks, n_mask, k_mask), x, gate, WIDEN)
            up = _times_rows(float_slab(up_rows, ks, n_mask, k_mask), x, up, WIDEN)
    else:
        gate = _quant_rows_times(x_rows, valid, w_expert, cols, n_mask, stride_wn, H, gate, QTYPE, BLOCK_N, WIDEN)
        up = _quant_rows_times(
            x_rows, valid, w_expert, cols + inter_size, n_mask, stride_wn, H, up, QTYPE, BLOCK_N, WIDEN
        )
    product = silu_product(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_M]
    out = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out, product, mask=valid[None, :] & n_mask[:, None])


@triton.heuristics({"WIDEN": lambda args: widen(args["inter_ptr"].dtype)})
@triton.jit
def _down_kernel(
    inter_ptr,
    w,
    blocks,
    weights_ptr,
    out_ptr,
    counts,
    inter_size,
    H,
    strides,
    QTYPE: tl.constexpr,
    SHARED_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
    UNGROUPED: tl.constexpr,
):
    """out[pair, cols] = down_e(inter[pair])[cols] * weight[pair], each rounded to the output dtype; the shared
    expert's pairs (SHARED_W, as `_gate_up_kernel`'s) unscaled. Grid (blocks, cdiv(H, BLOCK_N)).

    inter_ptr: the gated products [num_pairs, I]; w: the down weight operand, [E, H, I] (as `_gate_up_kernel`'s);
    blocks, counts: the block table; weights_ptr: float [routed_pairs] the routing weights; out_ptr: [num_pairs, H]
    in inter's dtype (out); strides: (stride_im, stride_we, stride_wn, stride_om); WIDEN (heuristic) and the rest
    as `_gate_up_kernel`'s."""
    pdl.wait_for_previous()
    stride_im, stride_we, stride_wn, stride_om = strides
    num_pairs, routed_pairs, E = counts
    expert, pairs = _block(blocks, counts, BLOCK_M, UNGROUPED)
    if expert < 0:
        return
    valid = pairs < num_pairs  # [BLOCK_M]
    safe_pairs = tl.where(valid, pairs, 0).to(tl.int64)
    x_rows = inter_ptr + safe_pairs[:, None] * stride_im  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < H
    w_expert = expert_weights(w, expert, E, stride_we, SHARED_W)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if QTYPE < 0:
        w_rows = w_expert + cols.to(tl.int64)[:, None] * stride_wn
        for k0 in range(0, inter_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < inter_size
            x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = _times_rows(float_slab(w_rows, ks, n_mask, k_mask), x, acc, WIDEN)
    else:
        acc = _quant_rows_times(
            x_rows, valid, w_expert, cols, n_mask, stride_wn, inter_size, acc, QTYPE, BLOCK_N, WIDEN
        )
    dtype = out_ptr.dtype.element_ty
    routed = valid & (pairs < routed_pairs)
    scale = tl.load(weights_ptr + safe_pairs, mask=routed, other=1.0).to(dtype).to(tl.float32)  # [BLOCK_M]
    scaled = (acc.to(dtype).to(tl.float32) * scale[None, :]).to(dtype)  # [BLOCK_N, BLOCK_M]
    out = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out, scaled, mask=valid[None, :] & n_mask[:, None])


@triton.heuristics({"P_PAD": lambda args: pairs_pad(args["num_pairs"]) if args["COUNT"] else 16})
@triton.jit
def _sum_kernel(
    per_pair_ptr,
    shared,
    out_ptr,
    experts_ptr,
    reads_ptr,
    num_pairs,
    H,
    strides,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    COUNT: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[token] = the float32 sum of per_pair[token * TOP_K + slot] over the slots whose expert is held (not
    -1), in slot order, rounded; with SHARED, plus sigmoid(logit[token]) * shared[token], rounded as the
    reference's dtype ops round. With COUNT (ungrouped blocks: no grouping kernel counted them) program (0, 0) adds
    the distinct experts among the pass's pairs to reads[0]. Grid (N, cdiv(H, BLOCK)).

    per_pair_ptr: [>= num_pairs, H] the down kernel's outputs, contiguous; shared: (shared_ptr, logit_ptr), the
    shared expert's product [N, H] and its gate logits [N] (placeholders without SHARED); out_ptr: [N, H] (out),
    contiguous; experts_ptr: int32 [num_pairs] the routing's experts, num_pairs = N * TOP_K; reads_ptr: int64 [1];
    strides: (stride_s, stride_l), shared's rows and the logits'; P_PAD (heuristic): the pairs as a power of two
    for the count."""
    pdl.wait_for_previous()
    shared_ptr, logit_ptr = shared
    stride_s, stride_l = strides
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        held = tl.load(experts_ptr + token * TOP_K + slot) >= 0  # else another rank's expert: no row was written
        row = per_pair_ptr + (token * TOP_K + slot) * H + cols
        total += tl.load(row, mask=mask & held, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if SHARED:
        shared_row = tl.load(shared_ptr + token * stride_s + cols, mask=mask, other=0.0)
        total = plus_shared(total, shared_row, logit_ptr, token, stride_l, dtype)
    tl.store(out_ptr + token * H + cols, total.to(dtype), mask=mask)
    if COUNT:
        if (token == 0) & (tl.program_id(1) == 0):
            count_distinct(experts_ptr, num_pairs, reads_ptr, P_PAD)


def grouped_products(ops: Operands, tile: Tile) -> None:
    """ops.out = the experts' products of `expert_products` with the pairs grouped by expert: gate|up, down,
    sum."""
    tokens, top_k = ops.experts.shape
    num_pairs, inter_size = ops.inter.shape
    hidden = ops.x.shape[-1]
    num_experts, routed_pairs = ops.num_experts, ops.routed_pairs
    if tile.ungrouped:  # block b is pair b alone: the routing is the block table, the sum kernel counts
        grouping = reference.Grouping(ops.experts, ops.experts.view(-1), tile.block_m)
        blocks = num_pairs
    else:
        experts, grouped = ops.experts.view(-1), num_experts
        if ops.shared_weights is not None:  # the shared expert's pairs are expert E's
            experts, grouped = torch.cat([experts, experts.new_full((tokens,), num_experts)]), num_experts + 1
        grouping = group_by_expert(experts.view(-1, 1), grouped, tile.block_m, ops.expert_reads, num_experts)
        blocks = grouping.experts.numel()
    launch = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
    launch |= {"UNGROUPED": tile.ungrouped, "num_warps": tile.num_warps, "num_stages": tile.num_stages}
    table = {"blocks": (grouping.pairs, grouping.experts), "counts": (num_pairs, routed_pairs, num_experts)}
    w, (stride_we, stride_wn), flags = ops.weight_args(down=False)
    _gate_up_kernel[(blocks, triton.cdiv(inter_size, tile.block_n))](
        ops.x,
        w=w,
        out_ptr=ops.inter,
        H=hidden,
        inter_size=inter_size,
        strides=(ops.x.stride(0), stride_we, stride_wn, ops.inter.stride(0)),
        TOP_K=top_k,
        **table,
        **flags,
        **launch,
        **pdl.LAUNCH,
    )
    per_pair = torch.empty(num_pairs, hidden, dtype=ops.x.dtype, device=ops.x.device)  # [pairs, H]
    w, (stride_we, stride_wn), flags = ops.weight_args(down=True)
    _down_kernel[(blocks, triton.cdiv(hidden, tile.block_n))](
        ops.inter,
        w=w,
        weights_ptr=ops.weights,
        out_ptr=per_pair,
        inter_size=inter_size,
        H=hidden,
        strides=(ops.inter.stride(0), stride_we, stride_wn, per_pair.stride(0)),
        **table,
        **flags,
        **launch,
        **pdl.LAUNCH,
    )
    shared, shared_strides = ops.shared_operand(
        per_pair[routed_pairs:] if ops.shared_weights is not None else ops.shared_out
    )
    _sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        per_pair,
        shared=shared,
        out_ptr=ops.out,
        experts_ptr=ops.experts,
        reads_ptr=ops.expert_reads,
        num_pairs=routed_pairs,
        H=hidden,
        strides=shared_strides,
        TOP_K=top_k,
        SHARED=ops.shared_logit is not None,
        COUNT=tile.ungrouped,
        BLOCK=SUM_BLOCK,
        **pdl.LAUNCH,
    )
