"""The MoE kernels' launches: the tile shapes (`Tile` for the grouped products, `PairTile` for the GEMVs per
pair, `RouterTile` for the fused router), the measured choices among them (`tile_for`, `router_tile`), and the
limits and flags every launch reads (`ALIGN_MAX_PAIRS`, `PAIR_MAX_TOKENS`, `FLOAT_DTYPES`, `PRMT`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton.quant_bits import INTERPRETED

ALIGN_MAX_PAIRS = 4096  # the one-program grouping's limit (a bitonic sort of the pairs)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUM_BLOCK = 1024
PAIR_MAX_TOKENS = 2  # passes of at most this many tokens skip the grouping (`tile_for`)
# the GGUF GEMVs' byte permutes as PTX (the interpreter takes shifts and masks); a constexpr the kernels read
PRMT = tl.constexpr(not INTERPRETED)


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


def pairs_pad(num_pairs: int) -> int:
    """The power of two (at least 16) that holds a pass's pairs: the one-program grouping's sort, and a decode
    pass's count of distinct experts (`products.count_distinct`)."""
    return max(16, triton.next_power_of_2(num_pairs))


def widen(dtype: torch.dtype) -> bool:
    """Whether the tensor-core products of activations of `dtype` run in float32 (no TF32): float32
    activations, or Triton's interpreter."""
    return dtype == torch.float32 or INTERPRETED
