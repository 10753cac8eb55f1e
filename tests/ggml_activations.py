"""llama.cpp's CPU products with quantized weights, reproduced on deltaspec's reference (test helper).

ggml's CPU backend multiplies a quantized weight by activations that it first quantizes to its `vec_dot_type`
(ggml-cpu.c `type_traits_cpu`): Q8_0 blocks of 32 for the 32-value types, Q8_1 for Q4_1 and Q5_1 (the same values,
and per block the float16 sum `s` of the values that the weight block's offset `m` multiplies instead of their
exact sum), Q8_K blocks of 256 for the k-quants, i-quants and ternary types. deltaspec
multiplies exact activations. `ggml_quantized_linear` rounds the activations as ggml's x86 code does
(`quantize_row_q8_0`: scale amax / 127 stored as float16, quants round(x * 127 / amax) half to even;
`quantize_row_q8_K_ref`: the value of largest magnitude `m` maps to -127, quants round(-127 / m * x) at most
127, scale 1 / (-127 / m) in float32), in the order the weight stores its columns, then multiplies by the
dequantized weight in the activations' dtype: what is left between deltaspec and llama-perplexity is float32
rounding. `ggml_activations()` makes it the product of every quantized weight (dense layers through the op
table, experts through `deltaspec.ops.moe`) for the models built inside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from deltaspec.ops import dispatch, moe
from deltaspec.ops.quant.weight import QuantizedWeight

Q8_0_TYPES = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q1_0", "Q4_1", "Q5_1")  # Q8_0 / Q8_1 activations
Q8_1_TYPES = ("Q4_1", "Q5_1")  # their blocks: float16 d, then float16 m
Q8_K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
Q8_K_TYPES += ("IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> its values after ggml's quantize_row_q8_0 (AVX2), in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    quants = torch.round(blocks * inverse)
    return (quants * (amax / 127.0).half().float()).reshape(x.shape)


def q8_1_sum_error(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> per block of 32 [..., n / 32], what quantize_row_q8_1's float16 sum `s` = d * sum(q) (d unrounded)
    exceeds the sum of the block's values after q8_0 rounding (float16 d times sum(q)), in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    total = torch.round(blocks * inverse.unsqueeze(-1)).sum(-1)
    d = amax / 127.0
    return (d * total).half().float() - d.half().float() * total


def block_offsets(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """The float16 offset `m` of each Q4_1 / Q5_1 block: [rows, row_bytes] -> [rows, blocks] float32."""
    size = {"Q4_1": 20, "Q5_1": 24}[qtype]
    blocks = data.reshape(data.shape[0], -1, size)
    return blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> its values after ggml's quantize_row_q8_K_ref, in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 256)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # the first value of largest magnitude
    iscale = torch.where(peak != 0, -127.0 / peak, torch.zeros_like(peak))
    quants = torch.round(iscale * blocks).clamp(max=127)
    scale = torch.where(peak != 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (quants * scale).reshape(x.shape)


def ggml_quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` with the activations of each segment rounded as ggml rounds them for its type."""
    stored = weight.ordered_input(x)
    parts = []
    for qtype, data in weight.segments:
        rounding = q8_0 if qtype in Q8_0_TYPES else q8_k if qtype in Q8_K_TYPES else None
        if rounding is None:
            pytest.fail(f"ggml_quantized_linear does not model ggml's activations for {qtype}")
        segment = QuantizedWeight([(qtype, data)], weight.in_features)
        product = F.linear(rounding(stored).to(x.dtype), segment.dequantize(x.dtype))
        if qtype in Q8_1_TYPES:  # m times llama.cpp's sum of the block's values instead of the exact one
            offsets = block_offsets(qtype, data).to(x.dtype)  # [rows, blocks]
            product = product + F.linear(q8_1_sum_error(stored).to(x.dtype), offsets)
        parts.append(product)
    return torch.cat(parts, dim=-1)


@contextlib.contextmanager
def ggml_activations():
    """Models built inside multiply their quantized weights with `ggml_quantized_linear`."""
    table, expert_product = dispatch.REFERENCE, moe.quantized_linear
    dispatch.REFERENCE = replace(table, quantized_linear=ggml_quantized_linear)
    moe.quantized_linear = ggml_quantized_linear
    try:
        yield
    finally:
        dispatch.REFERENCE, moe.quantized_linear = table, expert_product
