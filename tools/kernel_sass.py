"""Compile the one-row GGUF-block products (`deltaspec/ops/triton/quant_gemv.py`) for an H100/H200 (sm_90) on any
machine, no GPU needed, and count the SASS instructions of their main loop.

Triton's wheel carries ptxas, cuobjdump and nvdisasm, so the exact code the GPU would run can be read on a CPU
machine. For each kernel and tile (BLOCK_N weight rows, warps) it prints the registers per thread, the
instructions of the loop over super-blocks, those per weight value (a thread walks BLOCK_N * 256 / threads
values per iteration), and the commonest instructions; `--dump DIR` also writes each variant's SASS and
Triton GPU IR (the layouts, and any `convert_layout` that goes through shared memory). The count is a proxy: it
says what each weight costs in issue slots, not how well the loads overlap (measure that on the GPU).

    python tools/kernel_sass.py [q4_k q6_k q8_0] [--tiles=64x2,128x4] [--dump DIR]
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deltaspec.ops.triton import quant_gemv

COMMON = {
    "x_ptr": "*bf16",
    "order_ptr": "*bf16",
    "part_ptr": "*fp32",
    "arrivals_ptr": "*i32",
    "out_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "stride_xm": "i32",
    "stride_om": "i32",
    "steps": "i32",
    "steps_per_split": "i32",
}
KERNELS = {  # name -> (kernel, its pointer / size arguments beyond COMMON, the exponent argument)
    "q4_k": (quant_gemv.q4_k_gemv_kernel, {"w32_ptr": "*i32", "row_words": "i32"}, "half_exponent"),
    "q6_k": (quant_gemv.q6_k_gemv_kernel, {"w_ptr": "*u8", "w16_ptr": "*i16", "row_bytes": "i32"}, "half_exponent"),
    "q8_0": (quant_gemv.q8_0_gemv_kernel, {"w16_ptr": "*i16", "row_halves": "i32"}, "biased_exponent"),
}
ALIGNED = ("row_words", "row_bytes", "row_halves", "stride_xm", "stride_om", "N")  # as Triton specializes them
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_for_sm90(name: str, block_n: int, warps: int):
    """The kernel compiled for sm_90 with 16-byte-aligned pointers and sizes divisible by 16 (what the JIT
    specializes to for the model's shapes)."""
    kernel, own, exponent = KERNELS[name]
    arguments = list(kernel.arg_names)
    types = {**COMMON, **own, exponent: "i32"}
    signature = {a: types.get(a, "constexpr") for a in arguments}
    aligned = [a for a in arguments if types.get(a, "").startswith("*") or a in ALIGNED]
    attrs = {(arguments.index(a),): [["tt.divisibility", 16]] for a in aligned}
    constants = {"HAS_ORDER": False, "BLOCK_N": block_n, "PRMT": True, "M_BLOCK": 1}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def run_tool(tool: str, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, tool), *flags, f.name], capture_output=True, text=True).stdout


def loop_instructions(sass: str) -> collections.Counter:
    """The instructions between the loop's label and its backward branch."""
    lines = sass.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == ".L_x_1:")
    end = next(i for i in range(start, len(lines)) if "BRA `(.L_x_1)" in lines[i])
    return collections.Counter(m.group(1) for line in lines[start : end + 1] if (m := INSTRUCTION.search(line)))


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--") and a in KERNELS] or list(KERNELS)
    tiles_flag = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--tiles=")), "32x2,64x2,64x4,128x4")
    tiles = [tuple(int(v) for v in t.split("x")) for t in tiles_flag.split(",")]
    dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
    for name in names:
        for block_n, warps in tiles:
            compiled = compile_for_sm90(name, block_n, warps)
            cubin = compiled.asm["cubin"]
            sass = run_tool("nvdisasm", cubin, "-c")
            registers = re.search(r"REG:(\d+)", run_tool("cuobjdump", cubin, "--dump-resource-usage")).group(1)
            loop = loop_instructions(sass)
            per_thread = block_n * 256 / (warps * 32)
            total = sum(loop.values())
            common = ", ".join(f"{op} {n}" for op, n in loop.most_common(8))
            print(
                f"{name} BLOCK_N={block_n} warps={warps}: {registers} registers, loop {total} instructions, "
                f"{total / per_thread:.2f} per weight ({common})",
                flush=True,
            )
            if dump:
                os.makedirs(dump, exist_ok=True)
                stem = os.path.join(dump, f"{name}_{block_n}x{warps}")
                open(stem + ".sass", "w").write(sass)
                open(stem + ".ttgir", "w").write(compiled.asm["ttgir"])


if __name__ == "__main__":
    main()
