"""Triton mixture-of-experts kernels with the contracts of `deltaspec.ops.moe`: the router's top-k in one
kernel, and the routed experts' products either as a GEMV per (token, slot) pair (decode) or as grouped GEMMs
over the pairs sorted by expert (verify, batches, prefill).

Nothing reads a device value on the host, so MoE passes run inside CUDA graphs:
- `route`: softmax, top-k and renormalisation of a row's router logits in one program; `router`: for a few
  rows, the router's GEMV and that top-k in one launch, the last program of a row to finish routing it.
- decode, up to `PAIR_MAX_TOKENS` tokens: no grouping. Float experts run the grouped kernels below with one
  block per pair, the routing being the block table. For GGUF experts `_pair_gate_up_kernel` runs a GEMV per
  pair, reading the pair's expert from the routing, with SiLU and the gated product in its epilogue;
  `_pair_down_sum_kernel` takes a slab of a token's output columns through all its slots' down products scaled
  by the routing weights and sums them in float32 in slot order, with the gated shared expert: two launches.
  Their products are the dense decode GEMV's (`quant_gemv.q4_k_rows` and its siblings).
- a shared expert shaped and stored like the routed ones (the Qwen3.5 / Qwen3-Next layers) is expert E of the
  same launches, one pair per token after the routed pairs, its product unscaled and added gated in the sum;
  another one is multiplied first and its product read by the sum.
- more tokens: for up to `ALIGN_MAX_PAIRS` pairs one program sorts the pairs by expert and writes the block
  table (`_align_kernel`); longer passes (prefill) use the torch grouping, which also never syncs. Then one
  launch for every selected expert's gate|up product (`_gate_up_kernel`), one for the down products scaled by
  the routing weights (`_down_kernel`), and one that sums a token's top-k outputs in float32 in slot order
  (`_sum_kernel`; summing in the down kernel's epilogue would need atomics, whose order varies from run to
  run). A program takes one block of one expert's pairs and a slab of output columns, so each selected
  expert's weights are read once per pass, and blocks past the last used one return at once. The product puts
  the expert's output columns on the MMA's wide side and the pairs on its narrow side (padded to 16); GGUF
  blocks are dequantized in registers with the tile code of `quant_dequant` exactly as the reference
  dequantizes them.
Weights are float (bf16, fp16, fp32) or single-segment blocks of Q8_0, Q6_K, Q4_K, FP8_B128, I4_G32 or I4_G128.
Under expert parallelism the routing names another rank's experts -1: their pairs' programs return at once, the
grouping leaves them out and the sums skip them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaspec.ops import moe as reference
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton import activation, pdl, quant_gemv, quant_matmul
from deltaspec.ops.triton.quant_dequant import KERNEL_TYPES, _q4_k_half_chunk, _tile

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter multiplies bf16 dot operands raw
ALIGN_MAX_PAIRS = 4096  # the one-program grouping's limit (a bitonic sort of the pairs)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUM_BLOCK = 1024
PAIR_MAX_TOKENS = 2  # passes of at most this many tokens skip the grouping (`tile_for`)
PRMT = not INTERPRETED  # the GGUF GEMVs' byte permutes as PTX (the interpreter takes shifts and masks)
KernelWeight = tuple[int, torch.Tensor, int, int]  # QTYPE (-1: float), the stack, its stride per expert and per row


@dataclass(frozen=True)
class Tile:
    """A grouped product's launch: pairs per block (block_m), output columns and input values per program step;
    `ungrouped` blocks hold one pair each, so a decode pass needs no grouping launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    ungrouped: bool = False  # one block per pair, the routing its block table (no grouping kernel)


RouterTile = tuple[int, int, int]  # `_router_kernel`'s output columns per program, input values per slab, warps


def router_tile(rows: int) -> RouterTile | None:
    """The router's launch for a pass of `rows` rows, None where torch's GEMM and `route` are faster (more than
    16 rows). `tools/moe_kernel_sweep.py --router` on an H200 at 1d3d49e, the routers of `qwen3.5-35b-a3b` and
    `qwen3-next-80b-a3b` (hidden 2048) timed per layer: one weight row per one-warp program reading the whole
    row at once 4.9-5.5 us for the 35B router at 1-4 rows and 6.5-8.2 for the 80B one, against cuBLAS's GEMV
    and the one-warp `route` at 5.9 and 6.9 us for one row and 11-14 us from 2 rows on; eight weight rows per
    four-warp program 7.4-7.9 us at 8-16 rows; beyond 16 rows the GEMM's tensor cores win (8.8-13.4 us
    fused against 13.8-14.9 at 32 rows)."""
    if not 1 <= rows <= 16:
        return None
    return (1, 2048, 1) if rows <= 4 else (8, 512, 4)


@dataclass(frozen=True)
class PairTile:
    """A decode pass's launch, one GEMV per (token, slot) pair and no grouping: output columns per program of
    the gate|up product and of the down product (which also sums the slots), input values per step of float
    experts, warps per program."""

    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int = 4


def tile_for(tokens: int, top_k: int, num_experts: int, quantized: bool = False) -> Tile | PairTile:
    """Up to PAIR_MAX_TOKENS tokens no grouping (it would find almost every expert once, at the cost of a
    launch): one block per pair on tensor cores for float experts, a GEMV per pair for GGUF ones. More tokens,
    blocks as tall as the pairs an expert gets on average: verify passes give most selected experts a few
    pairs, prefill gives each many. The fastest launches of `tools/moe_kernel_sweep.py` on an H200 for
    `qwen3.5-35b-a3b` experts (bf16; Q4_K and Q6_K)."""
    if tokens <= PAIR_MAX_TOKENS:
        return PairTile(8, 4, 256, 2) if quantized else Tile(16, 64, 128, 4, 4, ungrouped=True)
    per_expert = tokens * top_k / num_experts
    if per_expert <= 16:
        return Tile(16, 32, 128, 4, 4) if quantized else Tile(16, 64, 128, 4, 4)
    if per_expert <= 64:
        return Tile(32, 64, 64, 4, 4)
    return Tile(64, 128, 64, 8, 3)


@triton.jit
def _top_k_of_row(
    logits_row,
    weights_ptr,
    experts_ptr,
    row,
    E,
    first,
    held,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    VOLATILE: tl.constexpr,
):
    """Row `row`'s softmax over the E logits at logits_row in float32, its TOP_K largest (lowest index first
    among equal ones), renormalised if NORMALIZE, stored as weights[row] and experts[row], each expert by its
    index among the `held` from `first` on, else -1 (VOLATILE: the logits were written by other programs of the
    launch)."""
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


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    E,
    first,
    held,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """`_top_k_of_row` of row `program_id`."""
    pdl.wait_for_previous()
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_l
    _top_k_of_row(logits_row, weights_ptr, experts_ptr, row, E, first, held, TOP_K, K_PAD, NORMALIZE, BLOCK_E, False)


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
            num_experts,
            first_expert,
            num_experts if held_experts is None else held_experts,
            logits.stride(0),
            TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k),
            NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
            num_warps=1 if num_experts <= 1024 else 4,  # one warp reduces with shuffles alone
            **pdl.LAUNCH,
        )
    return weights, experts


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    weights_ptr,
    experts_ptr,
    arrivals_ptr,
    E,
    first,
    held,
    OUT,
    H,
    stride_xm,
    stride_wn,
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
    routes the row (`_top_k_of_row` of its first E logits)."""
    pdl.wait_for_previous()
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < OUT
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    logit = _rows_times_x(x_row, w_ptr, cols, n_mask, stride_wn, H, 0, 0, -1, BLOCK_N, BLOCK_K, K_TILES, False)
    logits_row = logits_ptr + row.to(tl.int64) * OUT
    tl.store(logits_row + cols, logit.to(logits_ptr.dtype.element_ty), mask=n_mask)
    tl.debug_barrier()  # every thread's logits stored before the arrival (the atomic releases them)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.store(arrivals_ptr + row, 0)
        _top_k_of_row(logits_row, weights_ptr, experts_ptr, row, E, first, held, TOP_K, K_PAD, NORMALIZE, BLOCK_E, True)


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
        quant_matmul.arrival_counts(x.device, rows),
        num_experts,
        first_expert,
        num_experts if held_experts is None else held_experts,
        out_features,
        hidden,
        x.stride(0),
        weight.stride(0),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        NORMALIZE=normalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_TILES=triton.cdiv(hidden, block_k),
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return logits, weights, experts


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_kernel(
    experts_ptr,
    pairs_ptr,
    block_experts_ptr,
    scratch_ptr,
    reads_ptr,
    num_pairs,
    E,
    counted,
    slots,
    blocks,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """`deltaspec.ops.moe.group_by_expert` in one program: pairs sorted by (expert, pair) with a bitonic sort,
    each expert's count rounded up to whole blocks, each sorted pair written to its row, and each block's expert
    carried forward from the first block of every used expert. `scratch` [2, E_PAD] int32 lets the program
    gather per-expert starts by the sorted pairs' experts; the number of used experts below `counted` is added to
    reads[0]."""
    pdl.wait_for_previous()
    pair = tl.arange(0, P_PAD)
    expert = tl.load(experts_ptr + pair, mask=pair < num_pairs, other=E)  # [P_PAD], E past the pairs
    expert = tl.where(expert < 0, E, expert)  # pairs of no held expert (-1) are left out like those
    counts = tl.histogram(expert, E_PAD)  # [E_PAD]
    expert_ids = tl.arange(0, E_PAD)
    nblocks = tl.where(expert_ids < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tl.atomic_add(reads_ptr, tl.sum(((nblocks > 0) & (expert_ids < counted)).to(tl.int64), axis=0))
    block_end = tl.cumsum(nblocks, axis=0)
    block_start = block_end - nblocks
    pair_start = tl.cumsum(counts, axis=0) - counts
    tl.store(scratch_ptr + expert_ids, block_start)
    tl.store(scratch_ptr + E_PAD + expert_ids, pair_start)
    for start in range(0, slots, FILL):
        fill = start + tl.arange(0, FILL)
        tl.store(pairs_ptr + fill, num_pairs, mask=fill < slots)
    block = tl.arange(0, BLOCKS_PAD)
    tl.store(block_experts_ptr + block, -1, mask=block < blocks)
    tl.debug_barrier()
    keys = tl.sort(expert * P_PAD + pair)  # [P_PAD] sorted by expert, then pair
    sorted_expert = keys // P_PAD
    sorted_pair = keys % P_PAD
    used = sorted_expert < E
    first_block = tl.load(scratch_ptr + sorted_expert, mask=used, other=0)
    first_pair = tl.load(scratch_ptr + E_PAD + sorted_expert, mask=used, other=0)
    row = first_block * BLOCK_M + pair - first_pair  # position i of the sorted order is its rank + first_pair
    tl.store(pairs_ptr + row, sorted_pair, mask=used)
    tl.store(block_experts_ptr + block_start, expert_ids, mask=nblocks > 0)
    tl.debug_barrier()
    owner = tl.load(block_experts_ptr + block, mask=block < blocks, other=-1)
    owner = tl.associative_scan(owner, 0, _max)
    owner = tl.where(block < tl.sum(nblocks, axis=0), owner, -1)
    tl.store(block_experts_ptr + block, owner, mask=block < blocks)


def group_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int, expert_reads: torch.Tensor, counted: int | None = None
) -> reference.Grouping:
    """`deltaspec.ops.moe.group_by_expert`: one program for up to ALIGN_MAX_PAIRS pairs, else the torch one."""
    num_pairs = experts.numel()
    if num_pairs > ALIGN_MAX_PAIRS or num_pairs == 0:
        return reference.group_by_expert(experts, num_experts, block_m, expert_reads, counted)
    blocks = reference.max_blocks(num_pairs, num_experts, block_m)
    pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=experts.device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=experts.device)
    e_pad = triton.next_power_of_2(num_experts + 1)  # room for the sentinel expert E
    scratch = torch.empty(2 * e_pad, dtype=torch.int32, device=experts.device)
    p_pad = max(16, triton.next_power_of_2(num_pairs))
    _align_kernel[(1,)](
        experts,
        pairs,
        block_experts,
        scratch,
        expert_reads,
        num_pairs,
        num_experts,
        num_experts if counted is None else counted,
        blocks * block_m,
        blocks,
        P_PAD=p_pad,
        E_PAD=e_pad,
        BLOCKS_PAD=triton.next_power_of_2(blocks),
        FILL=1024,
        BLOCK_M=block_m,
        num_warps=8,
        **pdl.LAUNCH,
    )
    return reference.Grouping(pairs, block_experts, block_m)


@triton.jit
def _times_rows(w, x, acc, WIDEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, K] @ x [BLOCK_M, K].T, w rounded to x's dtype first."""
    if WIDEN:  # float32 products (no TF32): float32 activations, or Triton's interpreter
        return tl.dot(w.to(x.dtype).to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w.to(x.dtype), tl.trans(x), acc)


@triton.jit
def _float_slab(w_rows, ks, n_mask, k_mask):
    """w [BLOCK_N, BLOCK_K] of float weight rows `w_rows` (pointers [BLOCK_N, 1]) at columns ks."""
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)


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
    x_rows: pointers [BLOCK_M, 1] to the activation rows."""
    lane = tl.arange(0, 32)
    for step in range(0, K // 256):
        if QTYPE == 1:  # Q4_K: one 64-value chunk (two sub-blocks) at a time
            w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
            block = rows.to(tl.int64) * (row_bytes // 4) + step * 36
            head = tl.load(w32_ptr + block, mask=n_mask, other=0)
            s0 = tl.load(w32_ptr + block + 1, mask=n_mask, other=0)
            s1 = tl.load(w32_ptr + block + 2, mask=n_mask, other=0)
            s2 = tl.load(w32_ptr + block + 3, mask=n_mask, other=0)
            d = quant_gemv.half_bits(head)
            dmin = quant_gemv.half_bits(head >> 16)
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
def _block(pairs_ptr, block_experts_ptr, num_pairs, routed_pairs, E, BLOCK_M: tl.constexpr, UNGROUPED: tl.constexpr):
    """(expert, pairs [BLOCK_M]) of block `program_id(0)`: from the block table, or with UNGROUPED pair b alone in
    block b (block_experts_ptr is then the routing's experts [routed_pairs]; the shared expert's pairs after
    them are expert E)."""
    block = tl.program_id(0)
    if UNGROUPED:
        expert = tl.load(block_experts_ptr + block, mask=block < routed_pairs, other=E)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_pairs)
    else:
        expert = tl.load(block_experts_ptr + block)
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit
def _token_of(pairs, routed_pairs, TOP_K: tl.constexpr):
    """The token of each pair: routed pair p is token p // TOP_K's slot p % TOP_K, shared pair routed_pairs + t
    is token t's."""
    return tl.where(pairs < routed_pairs, pairs // TOP_K, pairs - routed_pairs)


@triton.jit
def _expert_weights(w_ptr, shared_w_ptr, expert, E, stride_we, SHARED_W: tl.constexpr):
    """Where `expert`'s weights start: in the routed stack, or (with SHARED_W) the shared expert's for expert E."""
    start = w_ptr + expert.to(tl.int64) * stride_we
    if SHARED_W:
        if expert == E:
            start = shared_w_ptr
    return start


@triton.jit
def _count_distinct(experts_ptr, num_pairs, reads_ptr, P_PAD: tl.constexpr):
    """reads[0] += the number of distinct held experts (not -1) among the pass's num_pairs <= P_PAD pairs."""
    index = tl.arange(0, P_PAD)
    chosen = tl.load(experts_ptr + index, mask=index < num_pairs, other=-1)  # [P_PAD]
    earlier = (chosen[:, None] == chosen[None, :]) & (index[None, :] < index[:, None])  # [P_PAD, P_PAD]
    first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & (index < num_pairs) & (chosen >= 0)
    tl.atomic_add(reads_ptr, tl.sum(first.to(tl.int64), axis=0))


@triton.jit
def _silu_product(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 products, each rounded to `dtype` as the reference's F.silu and product round."""
    gate = gate.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _plus_shared(total, shared, logit_ptr, token, stride_l, dtype: tl.constexpr):
    """total (float32 [BLOCK]) rounded to `dtype`, plus sigmoid(logit[token]) * shared (the shared expert's
    product [BLOCK], in `dtype`), rounded as the reference's `out + torch.sigmoid(logit) * shared_out` rounds;
    float32 out."""
    logit = tl.load(logit_ptr + token * stride_l).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
    return total.to(dtype).to(tl.float32) + (gate * shared.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    shared_w_ptr,
    pairs_ptr,
    block_experts_ptr,
    out_ptr,
    num_pairs,
    routed_pairs,
    E,
    H,
    inter_size,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
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
    expert (QTYPE -1: float weights [E, 2I, H] with strides; else GGUF blocks, stride_we bytes per expert and
    stride_wn bytes per row). num_pairs counts the routed pairs and, with SHARED_W, one pair per token for the
    shared expert (expert E, its weights [2I, H] at shared_w_ptr with the same row stride)."""
    pdl.wait_for_previous()
    expert, pairs = _block(pairs_ptr, block_experts_ptr, num_pairs, routed_pairs, E, BLOCK_M, UNGROUPED)
    if expert < 0:
        return
    valid = pairs < num_pairs  # [BLOCK_M]
    tokens = tl.where(valid, _token_of(pairs, routed_pairs, TOP_K), 0)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < inter_size
    w_expert = _expert_weights(w_ptr, shared_w_ptr, expert, E, stride_we, SHARED_W)
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if QTYPE < 0:
        gate_rows = w_expert + cols.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + inter_size * stride_wn
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < H
            x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            gate = _times_rows(_float_slab(gate_rows, ks, n_mask, k_mask), x, gate, WIDEN)
            up = _times_rows(_float_slab(up_rows, ks, n_mask, k_mask), x, up, WIDEN)
    else:
        gate = _quant_rows_times(x_rows, valid, w_expert, cols, n_mask, stride_wn, H, gate, QTYPE, BLOCK_N, WIDEN)
        up = _quant_rows_times(
            x_rows, valid, w_expert, cols + inter_size, n_mask, stride_wn, H, up, QTYPE, BLOCK_N, WIDEN
        )
    product = _silu_product(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_M]
    out = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out, product, mask=valid[None, :] & n_mask[:, None])


@triton.jit
def _down_kernel(
    inter_ptr,
    w_ptr,
    shared_w_ptr,
    pairs_ptr,
    block_experts_ptr,
    weights_ptr,
    out_ptr,
    num_pairs,
    routed_pairs,
    E,
    inter_size,
    H,
    stride_im,
    stride_we,
    stride_wn,
    stride_om,
    QTYPE: tl.constexpr,
    SHARED_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
    UNGROUPED: tl.constexpr,
):
    """out[pair, cols] = down_e(inter[pair])[cols] * weight[pair], each rounded to the output dtype; the shared
    expert's pairs (SHARED_W, as `_gate_up_kernel`'s) unscaled."""
    pdl.wait_for_previous()
    expert, pairs = _block(pairs_ptr, block_experts_ptr, num_pairs, routed_pairs, E, BLOCK_M, UNGROUPED)
    if expert < 0:
        return
    valid = pairs < num_pairs  # [BLOCK_M]
    safe_pairs = tl.where(valid, pairs, 0).to(tl.int64)
    x_rows = inter_ptr + safe_pairs[:, None] * stride_im  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < H
    w_expert = _expert_weights(w_ptr, shared_w_ptr, expert, E, stride_we, SHARED_W)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if QTYPE < 0:
        w_rows = w_expert + cols.to(tl.int64)[:, None] * stride_wn
        for k0 in range(0, inter_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < inter_size
            x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = _times_rows(_float_slab(w_rows, ks, n_mask, k_mask), x, acc, WIDEN)
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


@triton.jit
def _sum_kernel(
    per_pair_ptr,
    shared_ptr,
    logit_ptr,
    out_ptr,
    experts_ptr,
    reads_ptr,
    num_pairs,
    H,
    stride_s,
    stride_l,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    COUNT: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[token] = the float32 sum of per_pair[token * TOP_K + slot] over the slots whose expert is held (not
    -1), in slot order, rounded;
    with SHARED, plus sigmoid(logit[token]) * shared[token], rounded as the reference's dtype ops round. With
    COUNT (ungrouped blocks: no grouping kernel counted them) program (0, 0) adds the distinct experts among
    the pass's pairs to reads[0]."""
    pdl.wait_for_previous()
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
        shared = tl.load(shared_ptr + token * stride_s + cols, mask=mask, other=0.0)
        total = _plus_shared(total, shared, logit_ptr, token, stride_l, dtype)
    tl.store(out_ptr + token * H + cols, total.to(dtype), mask=mask)
    if COUNT:
        if (token == 0) & (tl.program_id(1) == 0):
            _count_distinct(experts_ptr, num_pairs, reads_ptr, P_PAD)


@triton.jit
def _rows_times_x(
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
    PRMT: tl.constexpr,
):
    """[BLOCK_N] float32: weight rows `rows` of one expert (at w_ptr; row_stride elements, or bytes for GGUF
    blocks) times the K activations at x_row, on CUDA cores: float rows in K_TILES = cdiv(K, BLOCK_K) slabs
    [BLOCK_N, BLOCK_K], GGUF rows with the decode GEMV's products (`quant_gemv`)."""
    if QTYPE < 0:
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * row_stride  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k_tile in tl.static_range(K_TILES):  # unrolled: every slab's load is issued before the first sum
            ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc += _float_slab(w_rows, ks, n_mask, k_mask).to(tl.float32) * x[None, :]
        result = tl.sum(acc, axis=1)
    elif QTYPE == 1:
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        start = rows.to(tl.int64) * (row_stride // 4)
        result = quant_gemv.q4_k_rows(
            x_row, x_row, w32_ptr, start, n_mask, 0, K // 256, half_exponent, False, BLOCK_N, PRMT
        )
    elif QTYPE == 3:
        start = rows.to(tl.int64) * row_stride
        result = quant_gemv.fp8_b128_rows(x_row, x_row, w_ptr, start, n_mask, 0, K // 256, False, BLOCK_N)
    elif QTYPE >= 4:  # I4_G32, I4_G128
        w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        start = rows.to(tl.int64) * (row_stride // 4)
        group: tl.constexpr = 32 if QTYPE == 4 else 128
        result = quant_gemv.i4_rows(
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
    x_row = x_ptr + _token_of(pair, routed_pairs, TOP_K).to(tl.int64) * stride_xm
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = cols < inter_size
    w_expert = _expert_weights(w_ptr, shared_w_ptr, expert, E, stride_we, SHARED_W)
    exps = (half_exponent, biased_exponent)
    gate = _rows_times_x(x_row, w_expert, cols, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT)
    up_rows = cols + inter_size
    up = _rows_times_x(x_row, w_expert, up_rows, n_mask, stride_wn, H, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT)
    product = _silu_product(gate, up, out_ptr.dtype.element_ty)  # [BLOCK_N]
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
            acc = _rows_times_x(
                x_row, w_expert, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT
            )
            scale = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
            total += (acc.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    if SHARED:
        if SHARED_W:
            x_row = inter_ptr + (routed_pairs + token).to(tl.int64) * stride_im
            shared = _rows_times_x(
                x_row, shared_w_ptr, cols, n_mask, stride_wn, inter_size, *exps, QTYPE, BLOCK_N, BLOCK_K, K_TILES, PRMT
            ).to(dtype)
        else:
            shared = tl.load(shared_ptr + token * stride_s + cols, mask=n_mask, other=0.0)
        total = _plus_shared(total, shared, logit_ptr, token, stride_l, dtype)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, total.to(dtype), mask=n_mask)
    if (tl.program_id(0) == 0) & (token == 0):
        _count_distinct(experts_ptr, routed_pairs, reads_ptr, P_PAD)


def _pairs_pad(num_pairs: int) -> int:
    """The power of two (at least 16) that holds a decode pass's pairs, for `_count_distinct`."""
    return max(16, triton.next_power_of_2(num_pairs))


def _kernel_weight(weight: torch.Tensor | QuantizedWeight) -> KernelWeight | None:
    """(QTYPE, tensor, per-expert stride, per-row stride) of an expert stack (or of one expert's [rows, in]
    weight) the kernels read, else None."""
    if isinstance(weight, torch.Tensor):
        if weight.dtype not in FLOAT_DTYPES or weight.stride(-1) != 1:
            return None
        return -1, weight, weight.stride(0) if weight.dim() == 3 else 0, weight.stride(-2)
    (qtype, data), *rest = weight.segments
    if rest or qtype not in KERNEL_TYPES or weight.input_order is not None or weight.in_features % 256:
        return None
    if not data.is_contiguous():
        return None
    return KERNEL_TYPES[qtype], data, data.stride(0) if data.dim() == 3 else 0, data.stride(-2)


def _routed_stacks(
    x_dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> tuple[KernelWeight, KernelWeight] | None:
    """The routed (gate|up, down) stacks as the kernels read them, or None where `expert_products` takes the
    reference loop (activations or weights the kernels do not take)."""
    if x_dtype not in FLOAT_DTYPES:
        return None
    stacks = (_kernel_weight(gate_up), _kernel_weight(down))
    return None if None in stacks else stacks


def fuses(x_dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight) -> bool:
    """Whether `expert_products` runs the kernels (else the reference loop, which syncs with the host)."""
    return _routed_stacks(x_dtype, gate_up, down) is not None


def experts_sync(
    dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> bool:
    """`deltaspec.ops.moe.experts_sync` for the kernels: only the products they leave to the reference sync."""
    return not fuses(dtype, gate_up, down)


def _as_expert(
    shared: torch.Tensor | QuantizedWeight, stack: torch.Tensor | QuantizedWeight, routed: KernelWeight
) -> torch.Tensor | None:
    """The shared expert's weight as the kernels read one more expert of the routed `stack` (same shape per
    expert, type and row stride), else None."""
    mine = _kernel_weight(shared)
    if mine is None or tuple(shared.shape) != tuple(stack.shape[1:]):
        return None
    qtype, tensor, _, row_stride = mine
    return tensor if (qtype, row_stride, tensor.dtype) == (routed[0], routed[3], routed[1].dtype) else None


def _shared_as_expert(
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    stacks: tuple[KernelWeight, KernelWeight],
    shared: reference.SharedExpert | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert's (gate|up, down) as the kernels read one more routed expert of `stacks` (the routed
    gate|up and down as `_routed_stacks` gives them), when it is shaped and stored like them (the Qwen3.5 /
    Qwen3-Next MoE layers: same intermediate size, same type) and the pass is no longer than the one-program
    grouping takes (decode, verify, batches), else None. A prefill's shared expert is a large dense product,
    faster as one GEMM than as one more expert's blocks (8k tokens of `qwen3.5-35b-a3b` on the H200: 21.2k
    tok/s as expert E, 25.2k apart)."""
    if shared is None or shared.logit.shape[0] * (top_k + 1) > ALIGN_MAX_PAIRS:
        return None
    pair = (_as_expert(shared.gate_up, gate_up, stacks[0]), _as_expert(shared.down, down, stacks[1]))
    return None if None in pair else pair


def runs_shared_as_expert(
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    shared: reference.SharedExpert,
    top_k: int,
) -> bool:
    """Whether `expert_products` multiplies `shared` in the routed experts' launches (else before them)."""
    stacks = _routed_stacks(shared.logit.dtype, gate_up, down)
    return stacks is not None and _shared_as_expert(gate_up, down, stacks, shared, top_k) is not None


@dataclass(frozen=True)
class _Operands:
    """What the expert kernels of one pass read and write. Pairs 0..routed_pairs-1 are the routing's (token p //
    top_k, slot p % top_k); with `shared_weights` the shared expert runs in the same launches as expert E, one
    pair per token after the routed ones."""

    x: torch.Tensor  # [N, H]
    gate_up: KernelWeight
    down: KernelWeight
    weights: torch.Tensor  # [N, top_k] float
    experts: torch.Tensor  # [N, top_k] int32
    expert_reads: torch.Tensor  # [1] int64
    shared_logit: torch.Tensor | None  # [N]
    shared_out: torch.Tensor | None  # [N, H] the shared expert's product computed outside the kernels
    shared_weights: tuple[torch.Tensor, torch.Tensor] | None  # gate|up, down of the shared expert as expert E
    inter: torch.Tensor  # [pairs, I] the gated products
    out: torch.Tensor  # [N, H]

    @property
    def routed_pairs(self) -> int:
        return self.experts.numel()

    @property
    def num_experts(self) -> int:
        return self.gate_up[1].shape[0]

    def weight_args(self, down: bool) -> dict:
        """The kernels' arguments for the routed gate|up (or down) stack: its type and strides, and the shared
        expert's weights with the SHARED_W flag (the routed stack as a placeholder when it is not expert E)."""
        qtype, stack, stride_e, stride_n = self.down if down else self.gate_up
        args = {"w_ptr": stack, "stride_we": stride_e, "stride_wn": stride_n, "QTYPE": qtype}
        if self.shared_weights is None:
            return args | {"shared_w_ptr": stack, "SHARED_W": False}
        return args | {"shared_w_ptr": self.shared_weights[int(down)], "SHARED_W": True}


def _shared_output(x: torch.Tensor, shared: reference.SharedExpert) -> torch.Tensor:
    """The shared expert's product outside the expert kernels (its weights are not one more expert of the
    stack's kind): the dense GGUF GEMM for blocks, torch's for float weights."""

    def linear(a: torch.Tensor, w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        return quant_matmul.quantized_linear(a, w) if isinstance(w, QuantizedWeight) else F.linear(a, w)

    return linear(activation.silu_mul(linear(x, shared.gate_up)), shared.down)


def expert_products(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    weights: torch.Tensor,
    experts: torch.Tensor,
    expert_reads: torch.Tensor,
    shared: reference.SharedExpert | None = None,
    tile: Tile | PairTile | None = None,
) -> torch.Tensor:
    """`deltaspec.ops.moe.expert_products` as a GEMV per pair (a few tokens) or as grouped kernels (`tile`
    overrides `tile_for`: tests, sweeps). A shared expert shaped and stored like the routed ones runs in the
    same launches as one more expert; another is multiplied first, its product added in the sum. Experts the
    kernels do not take (GGUF types other than theirs, say Q5_K) take the reference loop, their shared expert
    the dense kernels (`_shared_output`) rather than the reference's dequantize-then-multiply, rounded alike."""
    stacks = _routed_stacks(x.dtype, gate_up, down)
    if stacks is None and (shared is None or x.dtype not in FLOAT_DTYPES):
        return reference.expert_products(x, gate_up, down, weights, experts, expert_reads, shared)
    if stacks is None:
        routed = reference.expert_products(x, gate_up, down, weights, experts, expert_reads)
        return routed + torch.sigmoid(shared.logit)[:, None] * _shared_output(x, shared)
    tokens, top_k = experts.shape
    out = torch.empty(tokens, x.shape[-1], dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    tile = tile or tile_for(tokens, top_k, gate_up.shape[0], isinstance(gate_up, QuantizedWeight))
    shared_weights = _shared_as_expert(gate_up, down, stacks, shared, top_k)
    pairs = tokens * top_k + (tokens if shared_weights else 0)
    operands = _Operands(
        x=x.contiguous(),
        gate_up=stacks[0],
        down=stacks[1],
        weights=weights.contiguous(),
        experts=experts.to(torch.int32).contiguous(),
        expert_reads=expert_reads,
        shared_logit=None if shared is None else shared.logit,
        shared_out=_shared_output(x, shared) if shared is not None and shared_weights is None else None,
        shared_weights=shared_weights,
        inter=torch.empty(pairs, down.shape[-1], dtype=x.dtype, device=x.device),
        out=out,
    )
    if isinstance(tile, PairTile):
        _pair_products(operands, tile)
    else:
        _grouped_products(operands, tile)
    return out


def _pair_products(ops: _Operands, tile: PairTile) -> None:
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
        P_PAD=_pairs_pad(ops.routed_pairs),
        BLOCK_N=tile.down_n,
        K_TILES=triton.cdiv(inter_size, tile.block_k),
        **ops.weight_args(down=True),
        **launch,
        **pdl.LAUNCH,
    )


def _grouped_products(ops: _Operands, tile: Tile) -> None:
    """out = the experts' products of `expert_products` with the pairs grouped by expert: gate|up, down, sum."""
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
    widen = ops.x.dtype == torch.float32 or INTERPRETED
    launch = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "WIDEN": widen}
    launch |= {"UNGROUPED": tile.ungrouped, "num_warps": tile.num_warps, "num_stages": tile.num_stages}
    table = {"pairs_ptr": grouping.pairs, "block_experts_ptr": grouping.experts, "num_pairs": num_pairs}
    table |= {"routed_pairs": routed_pairs, "E": num_experts}
    _gate_up_kernel[(blocks, triton.cdiv(inter_size, tile.block_n))](
        ops.x,
        out_ptr=ops.inter,
        H=hidden,
        inter_size=inter_size,
        stride_xm=ops.x.stride(0),
        stride_om=ops.inter.stride(0),
        TOP_K=top_k,
        **table,
        **ops.weight_args(down=False),
        **launch,
        **pdl.LAUNCH,
    )
    per_pair = torch.empty(num_pairs, hidden, dtype=ops.x.dtype, device=ops.x.device)  # [pairs, H]
    _down_kernel[(blocks, triton.cdiv(hidden, tile.block_n))](
        ops.inter,
        weights_ptr=ops.weights,
        out_ptr=per_pair,
        inter_size=inter_size,
        H=hidden,
        stride_im=ops.inter.stride(0),
        stride_om=per_pair.stride(0),
        **table,
        **ops.weight_args(down=True),
        **launch,
        **pdl.LAUNCH,
    )
    shared_out = per_pair[routed_pairs:] if ops.shared_weights is not None else ops.shared_out
    shared_out = shared_out if shared_out is not None else ops.out  # a placeholder when there is none
    shared_logit = ops.shared_logit if ops.shared_logit is not None else ops.weights
    _sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        per_pair,
        shared_out,
        shared_logit,
        ops.out,
        ops.experts,
        ops.expert_reads,
        routed_pairs,
        hidden,
        shared_out.stride(0),
        shared_logit.stride(0),
        TOP_K=top_k,
        SHARED=ops.shared_logit is not None,
        COUNT=tile.ungrouped,
        P_PAD=_pairs_pad(routed_pairs) if tile.ungrouped else 16,
        BLOCK=SUM_BLOCK,
        **pdl.LAUNCH,
    )
