"""Triton mixture-of-experts kernels with the contracts of `deltaspec.ops.moe`: the router's top-k in one
kernel, and the routed experts' products either as a GEMV per (token, slot) pair (decode) or as grouped GEMMs
over the pairs sorted by expert (verify, batches, prefill).

Nothing reads a device value on the host, so MoE passes run inside CUDA graphs:
- `route`: softmax, top-k and renormalisation of a row's router logits in one program; `router`: for a few
  rows, the router's GEMV and that top-k in one launch, the last program of a row to finish routing it
  (`routing`).
- decode, up to `PAIR_MAX_TOKENS` tokens: no grouping. Float experts run the grouped kernels with one block per
  pair, the routing being the block table; GGUF experts run a GEMV per pair and one kernel that sums a token's
  slots with the gated shared expert: two launches (`pairs`).
- a shared expert shaped and stored like the routed ones (the Qwen3.5 / Qwen3-Next layers) is expert E of the
  same launches, one pair per token after the routed pairs, its product unscaled and added gated in the sum;
  another one is multiplied first and its product read by the sum (`operands`).
- more tokens: for up to `ALIGN_MAX_PAIRS` pairs one program sorts the pairs by expert and writes the block
  table (`grouping`); longer passes (prefill) use the torch grouping, which also never syncs. Then one launch for
  every selected expert's gate|up product, one for the down products scaled by the routing weights, and one that
  sums a token's top-k outputs in float32 in slot order (`grouped`).
Weights are float (bf16, fp16, fp32) or single-segment blocks of Q8_0, Q6_K, Q4_K, FP8_B128, I4_G32 or I4_G128.
Under expert parallelism the routing names another rank's experts -1: their pairs' programs return at once, the
grouping leaves them out and the sums skip them.

The modules, by role: `tiles` (the launches and their measured choices), `routing`, `grouping`, `grouped`,
`pairs` (the kernels, each with the host function that launches them), `products` (the device functions several
kernels share), `operands` (the host side of the expert products' operands) and `launch` (`expert_products`,
which picks the path). This package re-exports the names the op table, the tests and the tools use.
"""

from deltaspec.ops.triton.moe.grouping import group_by_expert
from deltaspec.ops.triton.moe.launch import expert_products
from deltaspec.ops.triton.moe.operands import KernelWeight, experts_sync, fuses, runs_shared_as_expert
from deltaspec.ops.triton.moe.routing import route, router
from deltaspec.ops.triton.moe.tiles import (
    ALIGN_MAX_PAIRS,
    FLOAT_DTYPES,
    INTERPRETED,
    PAIR_MAX_TOKENS,
    PRMT,
    SUM_BLOCK,
    PairTile,
    RouterTile,
    Tile,
    router_tile,
    tile_for,
)

__all__ = [
    "ALIGN_MAX_PAIRS",
    "FLOAT_DTYPES",
    "INTERPRETED",
    "PAIR_MAX_TOKENS",
    "PRMT",
    "SUM_BLOCK",
    "KernelWeight",
    "PairTile",
    "RouterTile",
    "Tile",
    "expert_products",
    "experts_sync",
    "fuses",
    "group_by_expert",
    "route",
    "router",
    "router_tile",
    "runs_shared_as_expert",
    "tile_for",
]
