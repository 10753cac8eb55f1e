"""`tools/kernel_sass.py` compiles the one-row GGUF-block products for sm_90 without a GPU, and the compiled Q4_K
loop turns each weight value into a float with exactly one `prmt` (the design `quant_gemv` documents)."""

import os
import sys

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))


def test_the_q4_k_loop_takes_one_permute_per_weight_value():
    import kernel_sass

    if not all(os.path.exists(os.path.join(kernel_sass.BIN, tool)) for tool in ("ptxas", "nvdisasm", "cuobjdump")):
        pytest.skip("this triton wheel carries no ptxas / nvdisasm / cuobjdump")
    compiled = kernel_sass.compile_for_sm90("q4_k", 64, 2)
    loop = kernel_sass.loop_instructions(kernel_sass.run_tool("nvdisasm", compiled.asm["cubin"], "-c"))
    values_per_thread = 64 * 256 // (2 * 32)
    assert loop["PRMT"] == values_per_thread
    assert values_per_thread <= loop["FFMA"] <= values_per_thread * 5 // 4  # one multiply-add per value + scales'
