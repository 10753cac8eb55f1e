"""Time launch configurations of the recurrent gated-delta-rule kernel (`deltaspec/ops/triton/gdn.py`) for
decode at the 27B shape's GDN sizes (16 key heads, 48 value heads of 128 x 128, float32 state), 1, 8 and 32
sequences: value columns per program x warps x pipeline stages. The chosen VALUE_BLOCK, RECURRENT_WARPS and
RECURRENT_STAGES come from this sweep on the H200.

    python tools/gdn_launch_sweep.py OUT.json        # CUDA only; about 40 s with compiles

Each line: sequences, columns, warps, stages, median µs per launch (triton.testing.do_bench, L2 flushed),
state bandwidth (read + write), and whether the output equals the 8-column, 1-warp launch's bit for bit
(wider programs sum over the key dimension in another order, so a False is rounding, not an error).
"""

import json
import sys

import torch
from triton.testing import do_bench

from deltaspec.ops.triton.gdn import _recurrent_kernel

KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 48, 128


def sweep(batch: int, device: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    q = torch.randn(batch, KEY_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)  # [B, Hk, D]
    k = torch.nn.functional.normalize(torch.randn(batch, KEY_HEADS, HEAD_DIM, device=device), dim=-1)
    k = k.to(torch.bfloat16)  # [B, Hk, D]
    v = torch.randn(batch, VALUE_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)  # [B, Hv, D]
    g = -torch.rand(batch, VALUE_HEADS, device=device)  # [B, Hv]
    beta = torch.rand(batch, VALUE_HEADS, device=device)  # [B, Hv]
    initial = 0.1 * torch.randn(batch + 1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device=device)  # [slots, Hv, D, D]
    query_start = torch.arange(batch + 1, device=device, dtype=torch.int32)
    slots = torch.arange(batch, device=device, dtype=torch.int64)
    zeros = torch.zeros(batch, device=device, dtype=torch.int32)  # nothing folded, nothing speculative
    results, reference = [], None
    for columns in (8, 16, 32, 64):
        for warps in (1, 2, 4, 8):
            for stages in (1, 2, 3):
                state = initial.clone()
                out = torch.empty(batch, VALUE_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

                def launch(columns=columns, warps=warps, stages=stages, out=out, state=state):
                    _recurrent_kernel[(batch, VALUE_HEADS, HEAD_DIM // columns)](
                        q,
                        k,
                        v,
                        g,
                        beta,
                        out,
                        state,
                        state,
                        state,
                        state,
                        state,
                        query_start,
                        slots,
                        zeros,
                        zeros,
                        q.stride(0),
                        q.stride(1),
                        k.stride(0),
                        k.stride(1),
                        v.stride(0),
                        v.stride(1),
                        g.stride(0),
                        beta.stride(0),
                        out.stride(0),
                        out.stride(1),
                        state.stride(0),
                        state.stride(1),
                        state.stride(2),
                        *(0,) * 10,
                        HEAD_RATIO=VALUE_HEADS // KEY_HEADS,
                        DK=HEAD_DIM,
                        DV=HEAD_DIM,
                        BK=HEAD_DIM,
                        BV=columns,
                        HAS_LOG=False,
                        num_warps=warps,
                        num_stages=stages,
                    )

                launch()
                reference = reference if reference is not None else out.clone()
                us = 1e3 * do_bench(launch, warmup=20, rep=100, return_mode="median")
                row = {
                    "sequences": batch,
                    "columns": columns,
                    "warps": warps,
                    "stages": stages,
                    "us": us,
                    "state_gb_s": 2 * state[:batch].numel() * 4 / us / 1e3,
                    "bitwise_equal": torch.equal(out, reference),
                }
                print(*row.values(), flush=True)
                results.append(row)
    return results


if __name__ == "__main__":
    rows = [row for batch in (1, 8, 32) for row in sweep(batch)]
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
