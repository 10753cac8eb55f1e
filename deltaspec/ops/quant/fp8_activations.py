"""FP8 activations for the prefill products of FP8 weights (W8A8), the reference: what vLLM, SGLang and
transformers' `FP8Linear` run for block-scaled FP8 checkpoints, here only where an engine asks for it.

Each row of the activations is cut into groups of 128 columns (the weight blocks' width); a group's scale is its
largest magnitude / 448 (1 for an all-zero group) and its values are rounded to float8 e4m3 after dividing by it.
The product of a group with a weight block is then (activation scale x block scale) x the sum of 128 products of
e4m3 values, which Hopper's FP8 tensor cores compute. Only products of more than `PREFILL_ROWS` rows (prompt
chunks, and batched passes that large) take it; decode and verify passes of fewer rows keep the exact product of
the dequantized weights. The Triton kernels of `deltaspec.ops.triton.fp8_matmul` follow this contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaspec.ops.quant.fp8 import BLOCK, E4M3_MAX, QTYPE
from deltaspec.ops.quant.weight import QuantizedWeight

PREFILL_ROWS = 64  # products of more rows than this quantize their activations (when asked to)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K divisible by 128) -> (values [M, K] float8_e4m3fn, scales [M, K / 128] float32): each row's
    groups of 128 columns scaled by their amax / 448, divided in float32 and rounded to nearest e4m3."""
    rows, columns = x.shape
    groups = x.to(torch.float32).view(rows, columns // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)  # [M, K/128]
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (groups / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(rows, columns), scales


def dequantize_activations(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The activations that `quantize_activations` keeps: values [M, K] e4m3 times their group's scale, in dtype."""
    rows, columns = values.shape
    groups = values.to(dtype).view(rows, columns // BLOCK, BLOCK)
    return (groups * scales.to(dtype)[..., None]).view(rows, columns)


def takes_fp8_activations(weight: QuantizedWeight, rows: int) -> bool:
    """Whether a product of `rows` rows with `weight` quantizes its activations: more than `PREFILL_ROWS` rows of
    a 2-D matrix made only of FP8 blocks."""
    return rows > PREFILL_ROWS and len(weight.shape) == 2 and all(qtype == QTYPE for qtype in weight.qtypes)


def fp8_activation_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) with x's rows quantized as above: the quantized activations and the
    dequantized weights multiplied in float64 for a float64 x, else float32, then cast to x's dtype."""
    flat = weight.ordered_input(x).reshape(-1, x.shape[-1])
    exact = torch.float64 if x.dtype == torch.float64 else torch.float32
    activations = dequantize_activations(*quantize_activations(flat), exact)  # [M, K]
    out = F.linear(activations, weight.dequantize(exact))  # [M, N]
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
