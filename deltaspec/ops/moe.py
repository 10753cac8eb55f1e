"""Mixture-of-experts ops, torch references (the spec): the router's top-k choice, the grouping of (token, slot)
pairs by expert that the fused expert kernels read, and the routed experts' SwiGLU products.

Rounding points (the kernels keep them): router probabilities in float32 (float64 for float64 logits), the
chosen weights renormalised there and rounded to the activations' dtype where they scale an expert's output;
each expert's gate|up product, SiLU, the gated product, the down product and its scaled output rounded to the
dtype as `F.linear` / `F.silu` would; the top-k outputs of a token summed in float32 (float64) in slot order,
then rounded once; the shared expert's product rounded as a routed expert's (unscaled), and added gated in the
dtype, as `out + sigmoid(g) * shared` rounds.
Under expert parallelism a rank holds experts first_expert .. first_expert + held_experts - 1 alone: the router
names the chosen experts by their index among those, -1 for another rank's, and the expert products skip those
pairs (the rank adds nothing for them; the all-reduce adds the rank that holds them).
Nothing here reads a device value on the host except `expert_products`, the readable loop over the experts a
pass selected.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaspec.ops.quant.weight import QuantizedWeight, quantized_linear


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, first_expert: int = 0, held_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, top_k] float32 (float64 for float64 logits), experts [N, top_k] int32):
    softmax over the experts, the top_k most probable (highest first), renormalised to sum to 1 if `normalize`.
    Each chosen expert is named by its index among the `held_experts` (default: all) from `first_expert` on,
    -1 where it is not one of them (expert parallelism: another rank's)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    held = logits.shape[-1] if held_experts is None else held_experts
    local = experts - first_expert
    return weights, torch.where((local >= 0) & (local < held), local, -1).to(torch.int32)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> (logits [N, OUT], weights [N, top_k], experts [N, top_k]): the router's product
    `product(x)` = x @ weight.T (+ bias), whose first `num_experts` columns are the experts' logits (the rest,
    a shared expert's gate), then `route` of those (with `first_expert`, `held_experts`). `weight` and `bias`
    are for kernels that fuse the two."""
    logits = product(x)
    return logits, *route(logits[:, :num_experts], top_k, normalize, first_expert, held_experts)


@dataclass(frozen=True)
class SharedExpert:
    """A MoE layer's shared expert, which every token goes through, gated by sigmoid(logit): gate_up [2I, H]
    (gate rows first), down [H, I] (float tensors or GGUF blocks), logit [N] (a column of the router's output)."""

    gate_up: torch.Tensor | QuantizedWeight
    down: torch.Tensor | QuantizedWeight
    logit: torch.Tensor


def expected_distinct_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """How many distinct experts a pass of `tokens` tokens selects on average if each token's top_k experts are
    a uniform draw: each expert is missed by a token with probability 1 - top_k / E. (256 experts, top 8:
    8 for one token, 102 for 16; a `qwen3.5-35b-a3b` 16-token verify on random weights reads about 102.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the row blocks of a grouping: each expert with rows rounds its count up to block_m,
    so sum(ceil(c_e / block_m)) <= pairs / block_m + (experts that have rows)."""
    return pairs // block_m + min(num_experts, pairs) + 1


@dataclass(frozen=True)
class Grouping:
    """(token, slot) pairs grouped by expert for a fused expert product. Pair p is token p // top_k's slot
    p % top_k. Each expert's pairs fill whole blocks of `block_m` rows, experts in increasing order.

    pairs:   [blocks * block_m] int32, the pair in each row of each block; `num_pairs` (N * top_k) where a
             block's rows run past its expert's pairs
    experts: [blocks] int32, each block's expert; -1 for the blocks after the last used one
    """

    pairs: torch.Tensor
    experts: torch.Tensor
    block_m: int


def group_by_expert(
    experts: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_reads: torch.Tensor | None = None,
    counted: int | None = None,
) -> Grouping:
    """The grouping of `experts` [N, top_k] (int32; -1: a pair of no held expert, left out): shapes depend only on
    N, top_k, E and block_m, and no value is read on the host, so it runs inside a CUDA graph. Within an expert,
    pairs keep their order. The number of distinct experts below `counted` (default: all) is added to
    `expert_reads` [1] int64 when given."""
    flat = experts.reshape(-1).long()  # [P]
    flat = torch.where(flat < 0, num_experts, flat)  # pairs left out sort last, as expert E, which has no blocks
    num_pairs = flat.numel()
    blocks_bound = max_blocks(num_pairs, num_experts, block_m)
    order = torch.argsort(flat, stable=True)  # [P] pairs sorted by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts = counts.index_add_(0, flat, torch.ones_like(flat))[:num_experts]  # [E] (the left-out pairs dropped)
    if expert_reads is not None:
        expert_reads += (counts[:counted] > 0).sum()
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = blocks.cumsum(0)  # [E]
    first_pair = counts.cumsum(0) - counts  # [E] where each expert's pairs start in `order`
    sorted_experts = flat[order]
    kept = sorted_experts < num_experts  # [P]
    held = torch.where(kept, sorted_experts, 0)
    rank = torch.arange(num_pairs, device=flat.device) - first_pair[held]
    rows = (block_end - blocks)[held] * block_m + rank  # [P] each sorted pair's row
    rows = torch.where(kept, rows, blocks_bound * block_m)  # left-out pairs land in a spare row, dropped below
    pairs = torch.full((blocks_bound * block_m + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, rows, order.to(torch.int32))
    pairs = pairs[:-1]
    block_ids = torch.arange(blocks_bound, device=flat.device)
    owner = torch.searchsorted(block_end, block_ids, right=True)  # [blocks] the expert whose blocks cover it
    block_experts = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return Grouping(pairs, block_experts, block_m)


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return quantized_linear(x, weight) if isinstance(weight, QuantizedWeight) else F.linear(x, weight)


def shared_output(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """x [N, H] -> the shared expert's down(silu(gate(x)) * up(x)) [N, H], rounded as a routed expert's product."""
    gate, up = _linear(x, shared.gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, shared.down)


def experts_sync(
    dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> bool:
    """Whether `expert_products` reads device values on the host: the reference loop always does."""
    return True


def expert_products(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    weights: torch.Tensor,
    experts: torch.Tensor,
    expert_reads: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """sum over slots j of weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], plus
    sigmoid(shared.logit[t]) * the shared expert's product of x_t.

    x [N, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]; weights [N, k] float; experts [N, k]
    int (-1: another rank's expert, which adds nothing) -> [N, H] in x's dtype, rounded as the module docstring
    says (the shared term and the sum with it as `out + torch.sigmoid(logit) * shared_output(x, shared)` round in
    x's dtype). Adds the distinct experts read to `expert_reads` [1] int64."""
    n, top_k = experts.shape
    chosen = [expert for expert in experts.unique().tolist() if expert >= 0]
    expert_reads += len(chosen)
    per_slot = torch.zeros(n, top_k, x.shape[-1], dtype=x.dtype, device=x.device)  # [N, k, H]
    scale = weights.to(x.dtype)
    for expert in chosen:
        tokens, slots = torch.where(experts == expert)
        gate, up = _linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        per_slot[tokens, slots] = _linear(F.silu(gate) * up, down[expert]) * scale[tokens, slots, None]
    total = per_slot[:, 0].to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    for slot in range(1, top_k):
        total += per_slot[:, slot]
    if shared is None:
        return total.to(x.dtype)
    return total.to(x.dtype) + torch.sigmoid(shared.logit)[:, None] * shared_output(x, shared)
