"""Compile the tensor-core and CUDA-core products of `deltaspec/ops/triton/quant_mma.py` (repacked Q4_K / Q6_K) and
`quant_mma_hf.py` (int4, FP8 and Q8_0 blocks), and the block tiles routed today, for an H100/H200 (sm_90) on any
machine, no GPU needed, and count the SASS instructions of their main loop per weight value, as
`tools/kernel_sass.py` does for the block GEMVs (a proxy for issue slots; measure speed on the GPU).

    python tools/quant_mma_sass.py
"""

import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deltaspec.ops.triton import quant_matmul, quant_mma, quant_mma_hf
from deltaspec.ops.triton.quant_dequant import KERNEL_TYPES
from tools.kernel_sass import INSTRUCTION, run_tool

COMMON = {"x_ptr": "*bf16", "part_ptr": "*fp32", "arrivals_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32"}
COMMON |= {"stride_xm": "i32", "stride_om": "i32", "steps": "i32", "steps_per_split": "i32", "half_exponent": "i32"}
Q4_K = {"words_ptr": "*i32", "heads_ptr": "*i32"}
Q6_K = {"words_ptr": "*i32", "high_ptr": "*i32", "scales_ptr": "*i8", "d_ptr": "*i16"}
I4 = {"w32_ptr": "*i32", "row_words": "i32"}
TILE = {"w_ptr": "*u8", "order_ptr": "*i64", "row_bytes": "i32"}
MMA = {"BLOCK_M": 16, "NUM_STAGES": 2, "PRMT": True, "IEEE": False}
GEMV = {"M_BLOCK": 1, "NUM_STAGES": 2, "PRMT": True}
I4_TILE = {"BLOCK_M": 16, "HAS_ORDER": False, "QTYPE": KERNEL_TYPES["I4_G128"], "IEEE": False}
FP8_TILE = {**I4_TILE, "QTYPE": KERNEL_TYPES["FP8_B128"]}
Q8_0 = {"w16_ptr": "*i16", "row_halves": "i32"}
Q8_0_MMA = {"BLOCK_M": 16, "NUM_STAGES": 2, "IEEE": False}
VARIANTS = [  # name, kernel, planes, constexprs, values per loop iteration and weight row, (BLOCK_N, warps) tiles
    (
        "q4_k mma",
        quant_mma.q4_k_mma_kernel,
        Q4_K,
        {**MMA, "VALUES": "bf16"},
        256,
        ((64, 4), (128, 4), (128, 8), (256, 8)),
    ),
    ("q4_k gemv", quant_mma.q4_k_gemv_kernel, Q4_K, GEMV, 256, ((64, 2), (128, 4), (256, 8))),
    ("q6_k mma", quant_mma.q6_k_mma_kernel, Q6_K, MMA, 256, ((64, 4), (128, 4), (128, 8))),
    ("q6_k gemv", quant_mma.q6_k_gemv_kernel, Q6_K, GEMV, 256, ((64, 2), (128, 4), (256, 8))),
    ("i4_g128 mma", quant_mma_hf.i4_mma_kernel, I4, {**MMA, "VALUES": "bf16"}, 128, ((64, 4), (128, 4), (128, 8))),
    ("i4_g128 tile (routed)", quant_matmul._tile_kernel, TILE, I4_TILE, 256, ((32, 4), (64, 4))),
    ("fp8_b128 mma", quant_mma_hf.fp8_mma_kernel, I4, {**MMA, "VALUES": "bf16"}, 128, ((64, 4), (128, 4), (128, 8))),
    ("fp8_b128 tile (routed)", quant_matmul._tile_kernel, TILE, FP8_TILE, 256, ((32, 4), (64, 4))),
    ("q8_0 mma", quant_mma_hf.q8_0_mma_kernel, Q8_0, Q8_0_MMA, 32, ((64, 4), (128, 4), (128, 8))),
    (
        "q8_0 tile (routed)",
        quant_matmul._tile_kernel,
        TILE,
        {**I4_TILE, "QTYPE": KERNEL_TYPES["Q8_0"]},
        256,
        ((32, 4),),
    ),
]


def compile_for_sm90(kernel, planes: dict, constants: dict, block_n: int, warps: int):
    """The kernel for sm_90 with 16-byte-aligned pointers and sizes divisible by 16 (as the JIT specializes)."""
    arguments = list(kernel.arg_names)
    types = {**COMMON, **planes}
    signature = {a: types.get(a, "constexpr") for a in arguments}
    aligned = [a for a in arguments if types.get(a, "").startswith("*") or a in ("N", "stride_xm", "stride_om")]
    attrs = {(arguments.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs={**constants, "BLOCK_N": block_n}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def largest_loop(sass: str) -> collections.Counter:
    """The instructions of the largest loop (a label and the backward branch to it; pipelining adds small ones)."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"^\s*\.L_x_\d+:\s*$", line)}
    loops = []
    for end, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), end) < end:
            body = lines[labels[target.group(1)] : end + 1]
            loops.append(collections.Counter(m.group(1) for text in body if (m := INSTRUCTION.search(text))))
    return max(loops, key=lambda loop: sum(loop.values()))


def main() -> None:
    for name, kernel, planes, constants, values, tiles in VARIANTS:
        for block_n, warps in tiles:
            cubin = compile_for_sm90(kernel, planes, constants, block_n, warps).asm["cubin"]
            loop = largest_loop(run_tool("nvdisasm", cubin, "-c"))
            registers = re.search(r"REG:(\d+)", run_tool("cuobjdump", cubin, "--dump-resource-usage")).group(1)
            total = sum(loop.values())
            per_thread = block_n * values / (warps * 32)  # values a thread walks per loop iteration
            common = ", ".join(f"{op} {n}" for op, n in loop.most_common(8))
            print(
                f"{name} BLOCK_N={block_n} warps={warps}: {registers} registers, loop {total} instructions, "
                f"{total / per_thread:.2f} per weight ({common})",
                flush=True,
            )


if __name__ == "__main__":
    main()
