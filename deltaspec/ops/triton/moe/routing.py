"""The router's kernels: `route`, the softmax, top-k and renormalisation of each row's router logits in one
program (`_route_kernel`); `router`, for a few rows the router's GEMV and that top-k in one launch
(`_router_kernel`), the last program of a row to finish routing it. Both name each chosen expert by its index
among the rank's held experts, -1 for another rank's (expert parallelism)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deltaspec.ops import moe as reference
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton import pdl, quant_bits
from deltaspec.ops.triton.moe.products import rows_times_x
from deltaspec.ops.triton.moe.tiles import FLOAT_DTYPES, RouterTile, router_tile

# the constexprs that follow from the other arguments: the top-k's and the experts' widths as powers of two
TOP_K_HEURISTICS = {
    "K_PAD": lambda args: triton.next_power_of_2(args["TOP_K"]),
    "BLOCK_E": lambda args: triton.next_power_of_2(args["span"][0]),
}


@triton.jit
def _top_k_of_row(
    logits_row,
    weights_ptr,
    experts_ptr,
    row,
    span,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    VOLATILE: tl.constexpr,
):
    """Row `row`'s softmax over the E logits at logits_row in float32, its TOP_K largest (lowest index first
    among equal ones), renormalised if NORMALIZE, stored as weights[row] and experts[row], each expert by its
    index among the `held` from `first` on, else -1 (span = (E, first, held); VOLATILE: the logits were written by
    other programs of the launch)."""
    E, first, held = span
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    logits = tl.load(logits_row + cols, mask=mask, other=-float("inf"), volatile=VOLATILE).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))  # [BLOCK_E], 0 where masked
    probs = tl.where(mask, exps / tl.sum(exps, axis=0), -1.0)
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        index = tl.min(tl.where(probs == best, cols, BLOCK_E), axis=0)
        chosen = tl.where(slots == slot, best, chosen)
        ids = tl.where(slots == slot, index, ids)
        probs = tl.where(cols == index, -1.0, probs)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    ids = ids - first
    ids = tl.where((ids >= 0) & (ids < held), ids, -1)
    out = row.to(tl.int64) * TOP_K + slots
    tl.store(weights_ptr + out, chosen, mask=slots < TOP_K)
    tl.store(experts_ptr + out, ids, mask=slots < TOP_K)


@triton.heuristics(TOP_K_HEURISTICS)
@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    span,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """`_top_k_of_row` of row `program_id(0)`; one program per row.

    logits_ptr: float [N, >= E] router logits, row stride stride_l (elements); weights_ptr: float32 [N, TOP_K],
    experts_ptr: int32 [N, TOP_K] (out); span: (E, first, held), the experts (each row's first E logits) and the
    rank's (first .. first + held - 1); TOP_K: experts per token; NORMALIZE: renormalise the chosen weights; K_PAD,
    BLOCK_E (heuristics): TOP_K and E as powers of two."""
    pdl.wait_for_previous()
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_l
    _top_k_of_row(logits_row, weights_ptr, experts_ptr, row, span, TOP_K, K_PAD, NORMALIZE, BLOCK_E, False)


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, first_expert: int = 0, held_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltaspec.ops.moe.route` in one kernel (float64 logits take the reference)."""
    if logits.dtype not in FLOAT_DTYPES:
        return reference.route(logits, top_k, normalize, first_expert, held_experts)
    rows, num_experts = logits.shape
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(rows, top_k, dtype=torch.int32, device=logits.device)
    if rows:
        _route_kernel[(rows,)](
            logits,
            weights,
            experts,
            (num_experts, first_expert, num_experts if held_experts is None else held_experts),
            logits.stride(0),
            TOP_K=top_k,
            NORMALIZE=normalize,
            num_warps=1 if num_experts <= 1024 else 4,  # one warp reduces with shuffles alone
            **pdl.LAUNCH,
        )
    return weights, experts


@triton.heuristics(TOP_K_HEURISTICS | {"K_TILES": lambda args: triton.cdiv(args["H"], args["BLOCK_K"])})
@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    weights_ptr,
    experts_ptr,
    arrivals_ptr,
    span,
    OUT,
    H,
    strides,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """logits[row, cols] = x[row] @ w[cols].T rounded to the logits' dtype, for BLOCK_N of the OUT columns; the
    last program of a row to finish (counted in arrivals[row], which it sets back to 0 for the next pass) then
    routes the row (`_top_k_of_row` of its first E logits). Grid (cdiv(OUT, BLOCK_N), N).

    x_ptr: float [N, H] activations; w_ptr: the router's weight [OUT, H] in x's dtype; logits_ptr: [N, OUT] in
    x's dtype, contiguous, weights_ptr: float32 [N, TOP_K], experts_ptr: int32 [N, TOP_K] (out); arrivals_ptr:
    int32 [N], zeros between launches; span, TOP_K, NORMALIZE as `_route_kernel`'s (the OUT - E columns past the
    experts' are a shared expert's gate); strides: (stride_xm, stride_wn), x's and w's row strides (elements);
    K_PAD, BLOCK_E, K_TILES = cdiv(H, BLOCK_K) (heuristics)."""
    pdl.wait_for_previous()
    stride_xm, stride_wn = strides
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < OUT
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    logit = rows_times_x(x_row, w_ptr, cols, n_mask, stride_wn, H, 0, 0, -1, BLOCK_N, BLOCK_K, K_TILES)
    logits_row = logits_ptr + row.to(tl.int64) * OUT
    tl.store(logits_row + cols, logit.to(logits_ptr.dtype.element_ty), mask=n_mask)
    tl.debug_barrier()  # every thread's logits stored before the arrival (the atomic releases them)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.store(arrivals_ptr + row, 0)
        _top_k_of_row(logits_row, weights_ptr, experts_ptr, row, span, TOP_K, K_PAD, NORMALIZE, BLOCK_E, True)


def router(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None,
    product: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
    top_k: int,
    normalize: bool,
    first_expert: int = 0,
    held_experts: int | None = None,
    tile: RouterTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`deltaspec.ops.moe.router`: where `router_tile` has a launch (or `tile` gives one: tests, the sweep), for
    float x and a float weight of x's dtype without bias, the product and the top-k in one launch
    (`_router_kernel`); else `product` (the op table's GEMM) and `route`."""
    rows, hidden = x.shape
    tile = tile or router_tile(rows)
    fused = tile is not None and rows > 0 and isinstance(weight, torch.Tensor) and bias is None
    fused = fused and x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype and weight.stride(-1) == 1 == x.stride(-1)
    if not fused:
        logits = product(x)
        return logits, *route(logits[:, :num_experts], top_k, normalize, first_expert, held_experts)
    out_features = weight.shape[0]
    logits = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=x.device)
    experts = torch.empty(rows, top_k, dtype=torch.int32, device=x.device)
    block_n, block_k, num_warps = tile
    _router_kernel[(triton.cdiv(out_features, block_n), rows)](
        x,
        weight,
        logits,
        weights,
        experts,
        quant_bits.arrival_counts(x.device, rows),
        (num_experts, first_expert, num_experts if held_experts is None else held_experts),
        out_features,
        hidden,
        (x.stride(0), weight.stride(0)),
        TOP_K=top_k,
        NORMALIZE=normalize,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return logits, weights, experts
