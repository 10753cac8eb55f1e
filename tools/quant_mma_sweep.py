"""Sweep the tensor-core Q4_K and Q6_K products on the repacked layouts (`deltaspec/ops/triton/quant_mma.py`) and
the int4 and FP8 ones on I4_G128 and FP8_B128 blocks (`quant_mma_hf.py`) on CUDA against the routed block products
(`quant_matmul`) and bf16 `F.linear`, all graph-timed over copies of the weight that exceed twice the L2 (as
`tools/quant_kernel_sweep.py --table`).

For each type, stage 1 times every kernel variant (BLOCK_N, warps, pipeline stages; split-K 4) at 16 rows of the
27B shape's gate_up product; stage 2 times the best few at every row count and shape with split-K 1, 2, 4 and 8,
and at 1 and 2 rows the repacked layouts' CUDA-core product too. Each result is checked against the dequantizing
reference. Writes one JSON line per timing to stderr and the whole report to the path given.

    python tools/quant_mma_sweep.py OUT.json [--rows=1,2,4,8,16] [--top=2] [--quick]
"""

import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from deltaspec.ops.quant.repacked import REPACKED, planes, repack
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton.quant_matmul import MMA_HF, launch_for, quantized_linear
from deltaspec.ops.triton.quant_mma import gemv, mma
from tests.ops.test_kernels_quant import random_weight
from tools.quant_kernel_sweep import copies_past_l2, graph_timed

SHAPES = {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "qkv_gdn": (10240 + 2 * 2048, 5120)}


def copies(make, nbytes: int) -> list:
    """Enough results of `make()` to exceed twice the L2 cache together."""
    return [make() for _ in range(copies_past_l2(nbytes))]


def timed(operands: list, call) -> float:
    """Median microseconds of `call(operand)` in a CUDA graph, each call taking the next operand."""
    return graph_timed(operands, call) * 1e3


CONFIG_KEYS = ("block_n", "num_warps", "num_stages")  # a variant, split-K apart


# CUDA-core launches on the repacked layouts for 1 and 2 rows: (block_n, num_warps, num_stages)
GEMVS = ((64, 2, 2), (128, 4, 2), (256, 8, 2))


def mma_call(qtype: str, x: torch.Tensor, out: torch.Tensor, config: dict, packed) -> torch.Tensor:
    if qtype in MMA_HF:  # the blocks as loaded, no planes
        return MMA_HF[qtype](x, packed, out, **config)
    if config.get("gemv"):
        return gemv(x, packed, out, REPACKED[qtype], **{key: value for key, value in config.items() if key != "gemv"})
    return mma(x, packed, out, REPACKED[qtype], **config)


def measure(qtype: str, shape: str, rows: int, configs: list[dict], fixtures: dict) -> list[dict]:
    """Each config's time at `rows` rows of `shape`, its error against the reference, and the routed launch's and
    bf16's times."""
    blocks, weights, packs, dense = fixtures[qtype, shape]
    n_out, n_in = SHAPES[shape]
    x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16)
    expected = quantized_linear(x, weights[0]).float()
    scale = expected.abs().max().item()
    base = {"qtype": qtype, "shape": shape, "rows": rows, "bytes": blocks.numel()}
    routed_us = timed(weights, functools.partial(quantized_linear, x))
    bf16_us = timed(dense, functools.partial(F.linear, x))
    records = [{**base, "kernel": "routed", "launch": launch_for(qtype, rows).__dict__, "us": routed_us}]
    records.append({**base, "kernel": "bf16", "us": bf16_us})
    for config in configs:
        out = torch.empty(rows, n_out, device="cuda", dtype=torch.bfloat16)
        try:
            got = mma_call(qtype, x, out, config, packs[0]).float()
            error = ((got - expected).abs().max() / scale).item()
            us = timed(packs, functools.partial(mma_call, qtype, x, out, config))
        except Exception as exc:  # a variant Triton cannot compile is recorded, not fatal
            records.append({**base, "kernel": "mma", **config, "failed": str(exc)[:300]})
            continue
        records.append({**base, "kernel": "mma", **config, "us": us, "max_rel_error": error})
    for record in records:
        if "us" in record:
            record["gb_s"] = record["bytes"] / record["us"] / 1e3
        print(json.dumps(record), file=sys.stderr, flush=True)
    return records


def main() -> None:
    rows_flag = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rows=")), "1,2,4,8,16")
    top = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--top=")), "2"))
    path = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    fixtures = {}
    for qtype in ("Q4_K", "Q6_K", *MMA_HF):
        for shape, (n_out, n_in) in SHAPES.items():
            blocks = random_weight(qtype, n_out, n_in, 0).cuda()
            weights = copies(lambda q=qtype, b=blocks, k=n_in: QuantizedWeight([(q, b.clone())], k), blocks.numel())
            if qtype in REPACKED:
                packs = [planes(repack(w.segments[0][1], qtype), REPACKED[qtype], n_in) for w in weights]
            else:
                packs = [w.segments[0][1] for w in weights]
            dense = copies(
                lambda s=(n_out, n_in): torch.randn(s, device="cuda", dtype=torch.bfloat16), n_out * n_in * 2
            )
            fixtures[qtype, shape] = (blocks, weights, packs, dense)
    quick = "--quick" in sys.argv  # a few variants, two shapes, split-K 4 and 8: what fits beside a test run
    stages = (2,) if quick else (1, 2, 3)
    grid = itertools.product((128, 256) if quick else (64, 128, 256), (4, 8), stages, (4,))
    q4_k_variants = [dict(zip((*CONFIG_KEYS, "split_k"), values)) for values in grid]
    grid = itertools.product((64, 128) if quick else (32, 64, 128), (4, 8), stages, (4,))
    q6_k_variants = [dict(zip((*CONFIG_KEYS, "split_k"), values)) for values in grid]
    grid = itertools.product((64, 128) if quick else (64, 128, 256), (4, 8), stages, (4,))
    block_variants = [dict(zip((*CONFIG_KEYS, "split_k"), values)) for values in grid]
    stage1, best, stage2 = [], {}, []
    typed = [("Q4_K", q4_k_variants), ("Q6_K", q6_k_variants), *((qtype, block_variants) for qtype in MMA_HF)]
    for qtype, variants in typed:
        timings = measure(qtype, "gate_up", 16, variants, fixtures)
        stage1 += timings
        ranked = sorted(
            (r for r in timings if r["kernel"] == "mma" and "us" in r and r["max_rel_error"] < 0.02),
            key=lambda r: r["us"],
        )
        best[qtype] = []
        for record in ranked:
            config = {key: record[key] for key in CONFIG_KEYS}
            if config not in best[qtype]:
                best[qtype].append(config)
            if len(best[qtype]) == top:
                break
        for shape in ("gate_up", "down") if quick else SHAPES:
            for rows in (int(r) for r in rows_flag.split(",")):
                configs = [
                    {**config, "split_k": k} for config in best[qtype] for k in ((4, 8) if quick else (1, 2, 4, 8))
                ]
                if rows <= (1 if quick else 2) and qtype in REPACKED:
                    configs += [
                        {"gemv": True, "block_n": n, "num_warps": w, "num_stages": st, "split_k": k}
                        for (n, w, st), k in itertools.product(GEMVS, (4, 8))
                    ]
                stage2 += measure(qtype, shape, rows, configs, fixtures)
    report = {"device": torch.cuda.get_device_name(), "stage1": stage1, "best": best, "stage2": stage2}
    print(report["device"], "best configs at 16 rows:", best)
    for qtype, shape in {(r["qtype"], r["shape"]) for r in stage2}:
        one_row = {}
        for rows in (int(r) for r in rows_flag.split(",")):
            here = [r for r in stage2 if (r["qtype"], r["shape"], r["rows"]) == (qtype, shape, rows) and "us" in r]
            routed = next(r["us"] for r in here if r["kernel"] == "routed")
            bf16 = next(r["us"] for r in here if r["kernel"] == "bf16")
            fine = [r for r in here if r["kernel"] == "mma" and r["max_rel_error"] < 0.02]
            mma = min((r for r in fine if not r.get("gemv")), key=lambda r: r["us"])
            gemv = min((r for r in fine if r.get("gemv")), key=lambda r: r["us"], default=None)
            one_row.setdefault("routed", routed)
            one_row.setdefault("mma", mma["us"])
            print(
                f"{qtype} {shape:8s} rows={rows:2d} routed {routed:7.1f} us ({routed / one_row['routed']:.2f}x) "
                f"mma {mma['us']:7.1f} us ({mma['us'] / one_row['routed']:.2f}x of routed 1 row, "
                f"{mma['gb_s']:5.0f} GB/s) n={mma['block_n']} w={mma['num_warps']} s={mma['num_stages']} "
                f"k={mma['split_k']}  bf16 {bf16:7.1f} us"
            )
            if gemv:
                print(
                    f"    repacked gemv {gemv['us']:7.1f} us n={gemv['block_n']} w={gemv['num_warps']} "
                    f"s={gemv['num_stages']} k={gemv['split_k']}"
                )
    text = json.dumps(report, indent=1)
    if path:
        open(path, "w").write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
