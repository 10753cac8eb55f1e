"""The grouping of a pass's (token, slot) pairs by expert that the grouped products read as their block table:
`group_by_expert`, one program (`_align_kernel`) for up to `ALIGN_MAX_PAIRS` pairs, else the torch grouping of
`deltaspec.ops.moe`, which never syncs with the host either."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.ops import moe as reference
from deltaspec.ops.triton import pdl
from deltaspec.ops.triton.moe.tiles import ALIGN_MAX_PAIRS, pairs_pad


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.heuristics(
    {
        "P_PAD": lambda args: pairs_pad(args["num_pairs"]),
        "BLOCKS_PAD": lambda args: triton.next_power_of_2(args["blocks"]),
    }
)
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
    carried forward from the first block of every used expert. The number of used experts below `counted` is added
    to reads[0].

    experts_ptr: int32 [num_pairs], each pair's expert (-1: another rank's, left out); pairs_ptr: int32 [slots =
    blocks * BLOCK_M] (out), each block's pairs, num_pairs past the last; block_experts_ptr: int32 [blocks] (out),
    each block's expert, -1 past the used ones; scratch_ptr: int32 [2, E_PAD], the per-expert starts the program
    gathers by the sorted pairs' experts; reads_ptr: int64 [1]; E: the experts (the pairs' ids are below it);
    E_PAD: a power of two above E (room for the sentinel expert E); FILL: pairs set per step; P_PAD, BLOCKS_PAD
    (heuristics): num_pairs (at least 16) and blocks as powers of two."""
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
        E_PAD=e_pad,
        FILL=1024,
        BLOCK_M=block_m,
        num_warps=8,
        **pdl.LAUNCH,
    )
    return reference.Grouping(pairs, block_experts, block_m)
