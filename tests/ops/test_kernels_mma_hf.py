"""The tensor-core products of int4, FP8 and Q8_0 blocks as loaded (`deltaspec.ops.triton.quant_mma_hf`) against the
dequantizing reference: int4 with random zero points and scales of both 16-bit types, FP8 with many subnormal
values; 2 to 16 rows, one share of the input and several, float32 and 16-bit activations, a permuted input order and
a partly empty tile, called directly and through `quantized_linear`'s "mma" launch."""

import pytest
import torch

from deltaspec.ops.quant.quantize import quantize
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.ops.test_kernels_quant import assert_near_the_reference, random_weight


def fp8_blocks_with_subnormals(rows: int, columns: int, seed: int) -> torch.Tensor:
    """FP8_B128 blocks of normal values where every other column is 10**-4 of its neighbours: e4m3 subnormals and
    zeros beside normal values in every block."""
    values = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    values[:, ::2] *= 1e-4
    return quantize(values, "FP8_B128")


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("qtype", ["I4_G128", "FP8_B128", "Q8_0"])
@pytest.mark.parametrize(("rows", "split_k", "ordered"), [(2, 1, False), (5, 3, True), (16, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_tensor_core_product_matches_the_reference(kernel_device, qtype, rows, split_k, ordered, dtype):
    from deltaspec.ops.triton.quant_matmul import MMA_HF, Launch, quantized_linear

    order = torch.randperm(768, generator=torch.Generator().manual_seed(3)) if ordered else None
    blocks = fp8_blocks_with_subnormals(40, 768, rows) if qtype == "FP8_B128" else random_weight(qtype, 40, 768, rows)
    weight = QuantizedWeight([(qtype, blocks)], 768, order).to(kernel_device)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(kernel_device, dtype)
    (_, data), *_ = weight.segments
    out = torch.empty(rows, 40, device=kernel_device, dtype=dtype)
    stored = x if order is None else x.index_select(1, order.to(kernel_device))
    MMA_HF[qtype](stored, data, out, block_n=32, split_k=split_k)
    assert_near_the_reference(out, x, weight)
    routed = quantized_linear(x, weight, Launch("mma", 64, split_k))  # the launch table's way in, order and all
    assert_near_the_reference(routed, x, weight)
