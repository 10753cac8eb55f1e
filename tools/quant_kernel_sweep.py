"""Sweep the launches of the GGUF-block products (`deltaspec/ops/triton/quant_matmul.py`) on CUDA.

For the 27B shape's largest decode products in Q4_K, Q6_K and Q8_0 (or `--types`) and row counts 1..64, times
every kernel family and tile (`Launch`) that applies with `triton.testing.do_bench` (L2 flushed before each call,
median), checks each result against the dequantizing reference, and records the achieved bandwidth (weight bytes /
time) next to bf16 `F.linear` on a matrix of the same shape; also the one-pass dequantization that prefill
products take (`quant_dequant`, bandwidth counting the blocks read and the bf16 matrix written). Prints the
best launch per (type, shape, rows) and writes everything as JSON to the path given (or stdout).

`--table` instead times the launches the table (`LAUNCHES`) routes each product to as decode runs them: in a
CUDA graph (`do_bench_cudagraph`, no launch overhead), each call reading the next of enough copies of the
weight that they exceed twice the L2 cache, so every call reads its blocks from DRAM, next to bf16 `F.linear`
timed the same way, and each row count's time relative to one row's (`vs_one_row`, when --rows includes 1).

    python tools/quant_kernel_sweep.py OUT.json [--quick] [--rows=1,2,4] [--types=Q4_K,FP8_B128] [--table]
"""

import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as reference
from deltaspec.ops.triton.quant_dequant import dequantize
from deltaspec.ops.triton.quant_matmul import Launch, launch_for, quantized_linear
from tests.ops.test_kernels_quant import random_weight

SHAPES = {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "qkv_gdn": (10240 + 2 * 2048, 5120)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
GEMV_ROWS = 16  # the most rows the GEMV candidates take (`Launch.m_block`)


def launches(qtype: str, rows: int, quick: bool) -> list[Launch]:
    """The candidate launches for `rows` rows of `qtype`."""
    splits = (1, 4) if quick else (1, 2, 4, 8)
    out = []
    if rows <= GEMV_ROWS:
        m_block = triton.next_power_of_2(rows)  # the whole of x in one row block
        gemvs = itertools.product((16, 32, 64, 128), (4, 8) if quick else (4, 8, 16), (2, 4, 8))
        out += [Launch("gemv", n, s, w, m_block=m_block) for n, s, w in gemvs]
    if rows == 1:  # tensor-core tiles pad one row to 16: never the fastest
        return out
    widths = (32, 64, 128) if qtype == "Q4_K" else (16, 32, 64)
    pairings = (True, False) if qtype == "Q4_K" else (True,)
    tiles = itertools.product(widths, splits[:3], (4, 8), pairings)
    return out + [Launch("tile", n, s, w, p) for n, s, w, p in tiles]


def dequantize_timing(qtype: str, name: str, weight: QuantizedWeight) -> dict:
    """The one-pass dequantization of `weight` to bfloat16: time, and bandwidth over blocks read + matrix written."""
    (_, data), *_ = weight.segments
    ms = do_bench(lambda: dequantize(data, qtype, torch.bfloat16), warmup=5, rep=20, return_mode="median")
    moved = weight.nbytes + data.shape[0] * weight.in_features * 2
    print(f"{qtype} {name:8s} dequantize {ms * 1e3:7.1f} us {moved / ms / 1e6:6.0f} GB/s", file=sys.stderr, flush=True)
    return {"qtype": qtype, "shape": name, "dequantize_ms": ms, "gb_s": moved / ms / 1e6}


def copies_past_l2(nbytes: int) -> int:
    """How many copies of an operand of `nbytes` exceed twice the L2 cache together."""
    return 2 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes + 1


def graph_timed(operands: list, call) -> float:
    """Median ms of `call(operand)` in a CUDA graph, each call taking the next of `operands`."""
    turn = itertools.cycle(operands)
    return do_bench_cudagraph(lambda: call(next(turn)), rep=30)


def table_timings(row_counts: tuple[int, ...], types: tuple[str, ...]) -> list[dict]:
    """The routed product of each type, shape and row count against bf16, each timed by `graph_timed` over
    copies of the weight that exceed twice the L2."""
    records = []
    for qtype in types:
        for name, (n_out, n_in) in SHAPES.items():
            blocks = random_weight(qtype, n_out, n_in, 0)
            weights = [QuantizedWeight([(qtype, blocks)], n_in).cuda() for _ in range(copies_past_l2(blocks.numel()))]
            dense = [
                torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
                for _ in range(copies_past_l2(n_out * n_in * 2))
            ]
            one_row_us = None
            for m in row_counts:
                x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
                ms = graph_timed(weights, functools.partial(quantized_linear, x))
                one_row_us = ms * 1e3 if m == 1 else one_row_us
                bf16_ms = graph_timed(dense, functools.partial(F.linear, x))
                record = {
                    "qtype": qtype,
                    "shape": name,
                    "rows": m,
                    "launch": launch_for(qtype, m).__dict__,
                    "us": ms * 1e3,
                    "gb_s": blocks.numel() / ms / 1e6,
                    "bf16_us": bf16_ms * 1e3,
                    "bf16_gb_s": n_out * n_in * 2 / bf16_ms / 1e6,
                    "vs_one_row": ms * 1e3 / one_row_us if one_row_us else None,
                }
                print(json.dumps(record), file=sys.stderr, flush=True)
                records.append(record)
            del weights, dense
    return records


def main() -> None:
    quick = "--quick" in sys.argv
    rows_flag = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rows=")), None)
    row_counts = tuple(int(r) for r in rows_flag.split(",")) if rows_flag else ROWS
    types_flag = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--types=")), None)
    types = tuple(types_flag.split(",")) if types_flag else ("Q4_K", "Q6_K", "Q8_0")
    path = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    if "--table" in sys.argv:
        report = {"device": torch.cuda.get_device_name(), "table": table_timings(row_counts, types)}
        text = json.dumps(report, indent=1)
        if path:
            open(path, "w").write(text + "\n")
        else:
            print(text)
        return
    results, best, dequantized = [], [], []
    for qtype in types:
        for name, (n_out, n_in) in SHAPES.items():
            weight = QuantizedWeight([(qtype, random_weight(qtype, n_out, n_in, 0))], n_in).cuda()
            dense = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
            dequantized.append(dequantize_timing(qtype, name, weight))
            for m in row_counts:
                x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
                expected = reference(x, weight).float()
                bf16_ms = do_bench(lambda x=x, dense=dense: F.linear(x, dense), warmup=5, rep=20, return_mode="median")
                timed = []
                for launch in launches(qtype, m, quick):
                    got = quantized_linear(x, weight, launch).float()
                    error = ((got - expected).abs().max() / expected.abs().max()).item()
                    ms = do_bench(
                        lambda x=x, weight=weight, launch=launch: quantized_linear(x, weight, launch),
                        warmup=5,
                        rep=20,
                        return_mode="median",
                    )
                    row = {
                        "qtype": qtype,
                        "shape": name,
                        "rows": m,
                        **launch.__dict__,
                        "ms": ms,
                        "gb_s": weight.nbytes / ms / 1e6,
                        "bf16_ms": bf16_ms,
                        "bf16_gb_s": dense.numel() * 2 / bf16_ms / 1e6,
                        "max_rel_error": error,
                    }
                    results.append(row)
                    timed.append(row)
                top = min((r for r in timed if r["max_rel_error"] < 0.05), key=lambda r: r["ms"])
                best.append(top)
                print(
                    f"{qtype} {name:8s} rows={m:2d} best {top['family']:4s} n={top['block_n']:3d} "
                    f"split={top['split_k']} warps={top['num_warps']} paired={top['paired']} "
                    f"{top['ms'] * 1e3:7.1f} us "
                    f"{top['gb_s']:6.0f} GB/s (bf16 {bf16_ms * 1e3:7.1f} us {row['bf16_gb_s']:6.0f} GB/s)",
                    file=sys.stderr,
                    flush=True,
                )
    text = json.dumps(
        {"device": torch.cuda.get_device_name(), "best": best, "dequantize": dequantized, "results": results}, indent=1
    )
    if path:
        open(path, "w").write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
