"""Sweep the launches of the MoE expert products (`deltaspec/ops/triton/moe/`) on CUDA.

For the routed experts of `qwen3.5-35b-a3b` (256 experts, top 8, hidden 2048, expert width 512) and
`qwen3-next-80b-a3b` (512, top 10), random bf16 experts and, for the first shape, Q4_K and Q6_K ones, with a
shared expert of the same kind and width gated by a router column (as in those models), times
`expert_products` for 1 to 8192 tokens with each candidate `Tile` (grouping, gate|up, down, sum) and, up to
PAIR_SWEEP_TOKENS tokens, the ungrouped tiles and each `PairTile` (a GEMV per pair: gate|up, then down with
the sum), as decode runs them: in a CUDA graph (`do_bench_cudagraph`), each graph running the product for 8
different routings so that the experts it reads exceed the L2 cache. Reports the time per product, the
distinct routed experts a product reads and the bandwidth that implies (their and the shared expert's bytes /
time), whether the shared expert ran as one more expert of the launches or apart, checks each result
against the reference loop, and marks the launch `tile_for` picks. Writes JSON lines to the path given, each
with the device and the project's commit.

With --router it times the router instead: for both shapes' routers (E + 1 outputs: the shared expert's gate)
and 1 to 32 rows, torch's GEMM followed by `route` against `router`'s one launch with each candidate tile,
40 routers (one per layer) in one graph, as a decode step runs them, and marks what `router_tile` picks;
each row also checks the logits against float64 and how far the chosen experts' exact logits fall short of
the exact top-k's (bf16 rounding can swap near-ties, by a few 1e-3).

    python tools/moe_kernel_sweep.py OUT.jsonl [--quick]     # --quick: decode launches, 1 and 2 tokens, first shape
    python tools/moe_kernel_sweep.py OUT.jsonl --router
"""

import functools
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from deltaspec.ops import moe as reference
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton import moe
from deltaspec.provenance import commit
from tests.ops.test_kernels_quant import random_weight

SHAPES = {"qwen3.5-35b-a3b": (256, 8, 2048, 512), "qwen3-next-80b-a3b": (512, 10, 2048, 512)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 8192)
TILES = (
    moe.Tile(16, 32, 128, 4, 4),
    moe.Tile(16, 64, 128, 4, 4),
    moe.Tile(16, 16, 256, 4, 4),
    moe.Tile(16, 32, 256, 4, 3),
    moe.Tile(16, 64, 64, 4, 4),
    moe.Tile(32, 64, 64, 4, 4),
    moe.Tile(64, 64, 64, 4, 3),
    moe.Tile(64, 128, 64, 8, 3),
    moe.Tile(128, 128, 64, 8, 3),
)
DECODE_TILES = (  # up to PAIR_SWEEP_TOKENS tokens: no grouping launch
    moe.Tile(16, 64, 128, 4, 4, ungrouped=True),
    moe.Tile(16, 32, 128, 4, 4, ungrouped=True),
    moe.Tile(16, 32, 256, 4, 3, ungrouped=True),
    moe.Tile(16, 64, 64, 4, 4, ungrouped=True),
    moe.PairTile(8, 4, 256, 2),
    moe.PairTile(8, 8, 512, 4),
    moe.PairTile(16, 8, 512, 4),
    moe.PairTile(4, 4, 1024, 2),
    moe.PairTile(16, 4, 512, 2),
    moe.PairTile(32, 16, 256, 4),
    moe.PairTile(32, 8, 256, 4),
)
PAIR_SWEEP_TOKENS = 4
ROUTINGS = 8
ROUTER_TILES = ((1, 2048, 1), (2, 2048, 1), (2, 1024, 2), (2, 512, 2), (4, 1024, 2), (4, 512, 4), (8, 512, 4))
ROUTER_LAYERS = 40


def experts_of(kind: str, num_experts: int, hidden: int, inter: int):
    """(gate_up, down, bytes per expert) on CUDA: bf16 tensors or single-type GGUF stacks of num_experts + 1
    experts, the last one to be the shared expert."""
    if kind == "bf16":
        gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        down = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
        return gate_up, down, (gate_up[0].nbytes + down[0].nbytes)
    blocks_gu = random_weight(kind, num_experts * 2 * inter, hidden, seed=1).view(num_experts, 2 * inter, -1)
    blocks_d = random_weight(kind, num_experts * hidden, inter, seed=2).view(num_experts, hidden, -1)
    gate_up = QuantizedWeight([(kind, blocks_gu.cuda())], hidden)
    down = QuantizedWeight([(kind, blocks_d.cuda())], inter)
    return gate_up, down, (blocks_gu[0].numel() + blocks_d[0].numel())


def main(out_path: str, quick: bool) -> None:
    torch.manual_seed(0)
    cases = [("qwen3.5-35b-a3b", "bf16"), ("qwen3.5-35b-a3b", "Q4_K"), ("qwen3.5-35b-a3b", "Q6_K")]
    if not quick:
        cases.append(("qwen3-next-80b-a3b", "bf16"))
    with open(out_path, "w") as out:
        for shape, kind in cases:
            num_experts, top_k, hidden, inter = SHAPES[shape]
            stacks = experts_of(kind, num_experts + 1, hidden, inter)
            gate_up, down = (stack[:num_experts] for stack in stacks[:2])
            shared_weights = (stacks[0][num_experts], stacks[1][num_experts])
            expert_bytes = stacks[2]
            for tokens in TOKENS[:2] if quick else TOKENS:
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                routings = [
                    moe.route(torch.randn(tokens, num_experts, device="cuda"), top_k, True) for _ in range(ROUTINGS)
                ]
                distinct = sum(int(r[1].unique().numel()) for r in routings) / ROUTINGS
                reads = torch.zeros(1, dtype=torch.int64, device="cuda")
                logit = torch.randn(tokens, device="cuda", dtype=torch.bfloat16)
                shared = reference.SharedExpert(*shared_weights, logit)
                wide_shared = reference.SharedExpert(*(_float(w) for w in shared_weights), logit.float())
                floats = (_float(gate_up), _float(down))
                check = reference.expert_products(x.float(), *floats, *routings[0], reads, wide_shared)
                as_expert = moe.runs_shared_as_expert(gate_up, down, shared, top_k)
                chosen = moe.tile_for(tokens, top_k, num_experts, kind != "bf16")
                candidates = (() if quick else TILES) + (DECODE_TILES if tokens <= PAIR_SWEEP_TOKENS else ())
                for tile in candidates if chosen in candidates else (chosen, *candidates):
                    if isinstance(tile, moe.Tile) and tile.block_m > 16 and tokens * top_k < 8 * num_experts:
                        if tile != chosen:
                            continue  # tall blocks only where experts get many pairs
                    got = moe.expert_products(x, gate_up, down, *routings[0], reads, shared, tile=tile)
                    error = ((got.float() - check).abs().max() / check.abs().max()).item()

                    def run(tile=tile, x=x, routings=routings, gate_up=gate_up, down=down, reads=reads, shared=shared):
                        for weights, experts in routings:
                            moe.expert_products(x, gate_up, down, weights, experts, reads, shared, tile=tile)

                    ms = do_bench_cudagraph(run, rep=100) / ROUTINGS
                    row = {
                        "device": torch.cuda.get_device_name(),
                        "commit": commit(),
                        "shape": shape,
                        "experts": kind,
                        "tokens": tokens,
                        "tile": _describe(tile),
                        "chosen": tile == chosen,
                        "us": 1000 * ms,
                        "distinct_experts": distinct,
                        "shared_expert": "expert" if as_expert else "apart",
                        "tb_s": (distinct + 1) * expert_bytes / (ms / 1000) / 1e12,
                        "max_rel_error": error,
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), flush=True)


def sweep_router(out_path: str) -> None:
    """Times the router's product and top-k as `router` runs them (and torch's GEMM + `route`, "torch+route")."""
    with open(out_path, "w") as out:
        for shape, (num_experts, top_k, hidden, _) in SHAPES.items():
            weights = [
                torch.randn(num_experts + 1, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
                for _ in range(ROUTER_LAYERS)
            ]
            for tokens in (1, 2, 4, 8, 16, 32):
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                want = F.linear(x.double(), weights[0].double())  # [tokens, E + 1]
                for tile in (None, *ROUTER_TILES):
                    run = functools.partial(_routers, x, weights, num_experts, top_k, tile)
                    run()  # compiles, and allocates the router's arrival counts outside the graph
                    ms = do_bench_cudagraph(run, rep=100) / ROUTER_LAYERS
                    if tile is None:
                        logits = F.linear(x, weights[0])
                        experts = moe.route(logits[:, :num_experts], top_k, True)[1]
                    else:
                        logits, _, experts = moe.router(x, weights[0], None, None, num_experts, top_k, True, tile=tile)
                    chosen = want[:, :num_experts].gather(1, experts.long())  # the chosen experts' exact logits
                    best = want[:, :num_experts].topk(top_k).values
                    row = {
                        "device": torch.cuda.get_device_name(),
                        "commit": commit(),
                        "shape": shape,
                        "tokens": tokens,
                        "router": "torch+route" if tile is None else "fused n={} k={} warps={}".format(*tile),
                        "chosen": tile == moe.router_tile(tokens),
                        "us": 1000 * ms,
                        "tb_s": weights[0].nbytes / (ms / 1000) / 1e12,
                        "max_rel_error": ((logits.double() - want).abs().max() / want.abs().max()).item(),
                        "top_k_logit_gap": (best.sum(-1) - chosen.sum(-1)).max().item(),  # 0: the exact top-k
                    }
                    out.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)


def _routers(x, weights, num_experts, top_k, tile) -> None:
    """x through each router of `weights`: torch's GEMM and `route` (tile None), else `router`'s launch `tile`
    (output columns per program, input values per slab, warps)."""
    for w in weights:
        if tile is None:
            moe.route(F.linear(x, w)[:, :num_experts], top_k, True)
        else:
            moe.router(x, w, None, None, num_experts, top_k, True, tile=tile)


def _describe(tile) -> str:
    if isinstance(tile, moe.PairTile):
        return f"pair gate_up_n={tile.gate_up_n} down_n={tile.down_n} k={tile.block_k} warps={tile.num_warps}"
    kind = "ungrouped" if tile.ungrouped else "grouped"
    return f"{kind} m={tile.block_m} n={tile.block_n} k={tile.block_k} warps={tile.num_warps} stages={tile.num_stages}"


def _float(weight):
    return weight.dequantize(torch.float32) if isinstance(weight, QuantizedWeight) else weight.float()


if __name__ == "__main__":
    if "--router" in sys.argv[2:]:
        sweep_router(sys.argv[1])
    else:
        main(sys.argv[1], "--quick" in sys.argv[2:])
