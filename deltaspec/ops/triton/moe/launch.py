"""`expert_products`: which path a pass's routed experts take, the reference loop (types and dtypes the kernels
do not take), a GEMV per pair (`pairs`, GGUF decode passes) or the grouped products (`grouped`), with the shared
expert as one more expert of the same launches or multiplied first (`operands`)."""

from __future__ import annotations

import torch

from deltaspec.ops import moe as reference
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton.moe.grouped import grouped_products
from deltaspec.ops.triton.moe.operands import Operands, routed_stacks, shared_as_expert, shared_output
from deltaspec.ops.triton.moe.pairs import pair_products
from deltaspec.ops.triton.moe.tiles import FLOAT_DTYPES, PairTile, Tile, tile_for


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
    the dense kernels (`shared_output`) rather than the reference's dequantize-then-multiply, rounded alike."""
    stacks = routed_stacks(x.dtype, gate_up, down)
    if stacks is None and (shared is None or x.dtype not in FLOAT_DTYPES):
        return reference.expert_products(x, gate_up, down, weights, experts, expert_reads, shared)
    if stacks is None:
        routed = reference.expert_products(x, gate_up, down, weights, experts, expert_reads)
        return routed + torch.sigmoid(shared.logit)[:, None] * shared_output(x, shared)
    tokens, top_k = experts.shape
    out = torch.empty(tokens, x.shape[-1], dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    tile = tile or tile_for(tokens, top_k, gate_up.shape[0], isinstance(gate_up, QuantizedWeight))
    shared_weights = shared_as_expert(gate_up, down, stacks, shared, top_k)
    pairs = tokens * top_k + (tokens if shared_weights else 0)
    operands = Operands(
        x=x.contiguous(),
        gate_up=stacks[0],
        down=stacks[1],
        weights=weights.contiguous(),
        experts=experts.to(torch.int32).contiguous(),
        expert_reads=expert_reads,
        shared_logit=None if shared is None else shared.logit,
        shared_out=shared_output(x, shared) if shared is not None and shared_weights is None else None,
        shared_weights=shared_weights,
        inter=torch.empty(pairs, down.shape[-1], dtype=x.dtype, device=x.device),
        out=out,
    )
    if isinstance(tile, PairTile):
        pair_products(operands, tile)
    else:
        grouped_products(operands, tile)
    return out
