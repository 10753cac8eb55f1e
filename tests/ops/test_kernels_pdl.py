"""Programmatic dependent launch (`deltaspec.ops.triton.pdl`, `DELTASPEC_PDL=1`): a chain of kernels that each
read what the one before wrote gives, bit for bit, what the same chain gives with the device synchronized after
every kernel (where no kernel can start early), run eagerly and replayed from a CUDA graph. The chain runs in a
process of its own, since the switch is read when the kernels are first compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaspec.ops.quant.weight import QuantizedWeight
from tests.ops.test_kernels_quant import random_weight

pytestmark = pytest.mark.gpu

HIDDEN = 2048
LAYERS = 24


def _chain(x, residual, weights, norm_weight, synchronize: bool):
    """LAYERS x (one-row FP8 product with its input split in shares, then the residual add and norm)."""
    from deltaspec.ops.triton import norms
    from deltaspec.ops.triton.quant_matmul import Launch, quantized_linear

    for weight in weights:
        y = quantized_linear(x, weight, Launch("gemv", 32, 4))
        if synchronize:
            torch.cuda.synchronize()
        x, residual = norms.add_rms_norm(y, residual, norm_weight, 1e-6)
        if synchronize:
            torch.cuda.synchronize()
    return x, residual


def check_dependent_chain() -> None:
    """The chain's outputs, eager and replayed, equal the synchronized chain's (in this process's launch mode)."""
    from deltaspec.ops.triton import pdl

    assert pdl.ENABLED, "programmatic dependent launch was not turned on"
    weights = [
        QuantizedWeight([("FP8_B128", random_weight("FP8_B128", HIDDEN, HIDDEN, seed))], HIDDEN).cuda()
        for seed in range(LAYERS)
    ]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    norm_weight = (torch.rand(HIDDEN, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    expected = _chain(x, residual, weights, norm_weight, synchronize=True)
    eager = _chain(x, residual, weights, norm_weight, synchronize=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _chain(x, residual, weights, norm_weight, synchronize=False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(replayed, expected):
            assert torch.equal(got, want)
    for got, want in zip(eager, expected):
        assert torch.equal(got, want)


def test_dependent_kernels_see_their_inputs():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs a CUDA device of compute capability 9.0 or later")
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {
        "DELTASPEC_PDL": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    code = "from tests.ops.test_kernels_pdl import check_dependent_chain; check_dependent_chain()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
