"""Dynamic FP8 activations for FP8 weights (`--fp8-activations dynamic`): the W8A8 product of prefill passes.

An FP8 checkpoint's `activation_scheme: dynamic` means its activations are to be quantized as they come: each
token's every 128 input features get one float32 scale, amax / 448, and are rounded to e4m3 (vLLM's block-FP8 path
and transformers' `FP8Linear` do so), so a product runs on FP8 tensor cores. deltaspec keeps activations in
their float dtype unless asked (W8A16: every row exact to the weights), and when asked quantizes them only for the
FP8_B128 segments of products of more than `DECODE_ROWS` rows: prefill chunks and wide batched passes. Passes of
up to 64 rows keep exact activations, so one stream's greedy speculation stays as exact as without; a wider
batched verify pass quantizes its rows too.

This module is the reference, the spec of the CUDA path (`deltaspec.ops.triton.w8a8`, Triton quantization and
cuBLAS's block-scaled FP8 product): activations quantized in float32, and each FP8 segment's product the sum of
(activation value x its scale) x (weight value x its block scale) accumulated in float32 (float64 for float64
activations), rounded once to the activations' dtype. Other segments (float parts, other block types) multiply
the unquantized activations as `quantized_linear` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaspec.ops.quant.dequant import dequantize
from deltaspec.ops.quant.fp8 import BLOCK, QTYPE
from deltaspec.ops.quant.fp8 import quantize_runs as quantize_activations  # per token, as FP8_B128 rows
from deltaspec.ops.quant.weight import QuantizedWeight, quantized_linear

DECODE_ROWS = 64  # products of at most this many rows keep their activations unquantized


def takes_dynamic(weight: QuantizedWeight, rows: int) -> bool:
    """Whether a product of `rows` rows by `weight` quantizes its activations: a 2-D weight with an FP8 segment,
    more than `DECODE_ROWS` rows."""
    return rows > DECODE_ROWS and len(weight.shape) == 2 and QTYPE in weight.qtypes


def dequantize_activations(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_activations` (`fp8.quantize_runs`), in `dtype`: values [M, K] times their run's
    scale [M, K / 128]."""
    m, k = values.shape
    runs = values.to(dtype).view(m, k // BLOCK, BLOCK) * scales.to(dtype)[..., None]
    return runs.view(m, k)


def fp8_dynamic_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) with the activations of FP8 segments quantized per token and 128
    features when the product has more than `DECODE_ROWS` rows (`takes_dynamic`); otherwise `quantized_linear`."""
    rows = x.numel() // x.shape[-1]
    if not takes_dynamic(weight, rows):
        return quantized_linear(x, weight)
    flat = weight.ordered_input(x).reshape(rows, x.shape[-1])
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    activations = dequantize_activations(*quantize_activations(flat), accumulate)
    parts = []
    for qtype, data in weight.segments:
        if qtype == QTYPE:
            parts.append(F.linear(activations, dequantize(data, qtype).to(accumulate)).to(x.dtype))
        else:
            parts.append(F.linear(flat, dequantize(data, qtype).to(x.dtype)))
    return torch.cat(parts, dim=-1).view(*x.shape[:-1], weight.shape[0])
