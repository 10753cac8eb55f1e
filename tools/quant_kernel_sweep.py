"""Sweep the launch settings of the GGUF-block product (`deltaspec/ops/triton/quant_matmul.py`) on CUDA.

For the 27B shape's largest decode products in Q4_K, Q6_K and Q8_0, times each (block_n, split_k) at 1, 4 and 16
rows with CUDA events (median of 50 after warm-up), checks the result against the dequantizing reference, and
prints the achieved bandwidth (weight bytes / time) next to bf16 `F.linear` on the same matrix. Writes JSON to
the path given (or stdout).

    python tools/quant_kernel_sweep.py OUT.json
"""

import json
import statistics
import sys

import torch
import torch.nn.functional as F

from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.quant.weight import quantized_linear as reference
from deltaspec.ops.triton.quant_matmul import quantized_linear
from tests.test_kernels_quant import random_weight

SHAPES = {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "qkv_gdn": (10240 + 2 * 2048, 5120)}
SETTINGS = [(16, 1), (32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (16, 4), (16, 8)]


def timed(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    results = []
    for qtype in ("Q4_K", "Q6_K", "Q8_0"):
        for name, (rows, cols) in SHAPES.items():
            weight = QuantizedWeight([(qtype, random_weight(qtype, rows, cols, 0))], cols).cuda()
            dense = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            for m in (1, 4, 16):
                x = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
                expected = reference(x, weight).float()
                bf16_ms = timed(lambda x=x, dense=dense: F.linear(x, dense))
                for block_n, split_k in SETTINGS:
                    got = quantized_linear(x, weight, block_n, split_k).float()
                    error = ((got - expected).abs().max() / expected.abs().max()).item()
                    ms = timed(lambda x=x, w=weight, n=block_n, k=split_k: quantized_linear(x, w, n, k))
                    results.append(
                        {
                            "qtype": qtype,
                            "shape": name,
                            "rows": m,
                            "block_n": block_n,
                            "split_k": split_k,
                            "ms": ms,
                            "gb_s": weight.nbytes / ms / 1e6,
                            "bf16_ms": bf16_ms,
                            "bf16_gb_s": dense.numel() * 2 / bf16_ms / 1e6,
                            "max_rel_error": error,
                        }
                    )
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    text = json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
