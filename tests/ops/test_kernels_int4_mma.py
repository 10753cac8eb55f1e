"""The int4 tensor-core product (`deltaspec.ops.triton.quant_mma_hf`) against the dequantizing reference: random
zero points and scales of both 16-bit types, 2 to 16 rows, one share of the input and several, float32 and 16-bit
activations, a permuted input order and a partly empty tile."""

import pytest
import torch

from deltaspec.ops.quant.weight import QuantizedWeight
from tests.ops.test_kernels_quant import assert_near_the_reference, random_weight


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize(("rows", "split_k", "ordered"), [(2, 1, False), (5, 3, True), (16, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int4_tensor_core_product_matches_the_reference(kernel_device, rows, split_k, ordered, dtype):
    from deltaspec.ops.triton.quant_matmul import Launch, quantized_linear
    from deltaspec.ops.triton.quant_mma_hf import i4_mma

    order = torch.randperm(768, generator=torch.Generator().manual_seed(3)) if ordered else None
    weight = QuantizedWeight([("I4_G128", random_weight("I4_G128", 40, 768, seed=rows))], 768, order)
    weight = weight.to(kernel_device)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(kernel_device, dtype)
    (_, data), *_ = weight.segments
    out = torch.empty(rows, 40, device=kernel_device, dtype=dtype)
    stored = x if order is None else x.index_select(1, order.to(kernel_device))
    i4_mma(stored, data, out, block_n=32, split_k=split_k)
    assert_near_the_reference(out, x, weight)
    routed = quantized_linear(x, weight, Launch("mma", 64, split_k))  # the launch table's way in, order and all
    assert_near_the_reference(routed, x, weight)
