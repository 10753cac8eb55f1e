"""FP8 weights times FP8 activations on tensor cores (W8A8), for prefill products: the contract of
`deltaspec.ops.quant.fp8_activations` on CUDA devices of compute capability 8.9 or more (Ada, Hopper).

`quantize_kernel` cuts each activation row into groups of 128 columns and writes their e4m3 values and float32
scales (amax / 448, divided exactly). `matmul_kernel` reads the weight's FP8_B128 blocks in place (per row,
blocks of a float32 scale and 128 e4m3 bytes) and the quantized activations, and for each 128-column step adds
one FP8 tensor-core product [BLOCK_M, 128] x [128, BLOCK_N] times the outer product of the activation and weight
scales to a float32 accumulator, in a fixed order, so a row's result does not depend on the other rows. Programs
are grouped along M (GROUP_M) so that neighbouring programs share weight tiles in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaspec.ops.quant.fp8 import BLOCK, BLOCK_BYTES, QTYPE
from deltaspec.ops.quant.weight import QuantizedWeight

QUANTIZE_GROUPS = 8  # activation groups of 128 columns per program of `quantize_kernel`


@dataclass(frozen=True)
class MatmulLaunch:
    """Tile of one program of `matmul_kernel` (128 columns deep), warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    unroll: int = 1  # 128-column steps per loop iteration, 1 or 2 (2 only where it divides the steps)


LAUNCH = MatmulLaunch()


@triton.jit
def quantize_kernel(x_ptr, values_ptr, scales_ptr, M, K, stride_xm, GROUPS: tl.constexpr):
    """Program (row, g): groups g * GROUPS .. of 128 columns of row `row` -> their e4m3 values and scales."""
    row = tl.program_id(0)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    g_mask = group < K // 128
    columns = group[:, None] * 128 + tl.arange(0, 128)[None, :]  # [GROUPS, 128]
    x = tl.load(x_ptr + row * stride_xm + columns, mask=g_mask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GROUPS]
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    scaled = tl.math.div_rn(x, scale[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    tl.store(values_ptr + row * K + columns, scaled.to(tl.float8e4nv), mask=g_mask[:, None])
    tl.store(scales_ptr + row * (K // 128) + group, scale, mask=g_mask)


@triton.jit
def matmul_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    steps,
    row_bytes,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    UNROLL: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """out [M, N] = the e4m3 activations a [M, steps * 128] (scales [M, steps]) times the FP8_B128 rows [N,
    row_bytes] transposed. Rows past M or N are read at a valid row (clamped) and never stored."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_read = tl.minimum(m, M - 1).to(tl.int64)
    n_read = tl.minimum(n, N - 1).to(tl.int64)
    k = tl.arange(0, 128)
    w32_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    w8_ptr = w_ptr.to(tl.pointer_type(tl.float8e4nv))  # loaded as e4m3 straight into the product's shared memory
    a_rows = a_ptr + m_read[:, None] * (steps * 128) + k[None, :]  # [BLOCK_M, 128]
    w_rows = n_read * row_bytes  # [BLOCK_N] bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, steps, UNROLL):
        product, scale = _step(a_rows, a_scale_ptr, w8_ptr, w32_ptr, w_rows, m_read, k, first, steps, BLOCK_BYTES)
        if UNROLL == 2:  # a second product issued before the first is scaled
            second, second_scale = _step(
                a_rows, a_scale_ptr, w8_ptr, w32_ptr, w_rows, m_read, k, first + 1, steps, BLOCK_BYTES
            )
            acc += product * scale + second * second_scale
        else:
            acc += product * scale
    mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _step(a_rows, a_scale_ptr, w8_ptr, w32_ptr, w_rows, m_read, k, step, steps, BLOCK_BYTES: tl.constexpr):
    """128-column step `step`: the e4m3 product [BLOCK_M, BLOCK_N] (float32 sums) and its scales' outer product."""
    a = tl.load(a_rows + step * 128)  # [BLOCK_M, 128] e4m3
    block = w_rows + step * BLOCK_BYTES  # [BLOCK_N] bytes: the block's scale, then its values
    w = tl.load(w8_ptr + block[:, None] + 4 + k[None, :])  # [BLOCK_N, 128] e4m3
    a_scale = tl.load(a_scale_ptr + m_read * steps + step)  # [BLOCK_M]
    w_scale = tl.load(w32_ptr + block // 4).to(tl.float32, bitcast=True)  # [BLOCK_N]
    return tl.dot(a, tl.trans(w)), a_scale[:, None] * w_scale[None, :]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (values [M, K] float8_e4m3fn, scales [M, K / 128] float32), as the reference."""
    m, k = x.shape
    values = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, k // BLOCK, device=x.device, dtype=torch.float32)
    grid = (m, triton.cdiv(k // BLOCK, QUANTIZE_GROUPS))
    quantize_kernel[grid](x, values, scales, m, k, x.stride(0), GROUPS=QUANTIZE_GROUPS, num_warps=4)
    return values, scales


def fp8_activation_linear(x: torch.Tensor, weight: QuantizedWeight, launch: MatmulLaunch = LAUNCH) -> torch.Tensor:
    """`x @ weight.T` ([..., in] -> [..., out]) for a matrix of FP8_B128 blocks, with x's rows quantized to e4m3
    (`deltaspec.ops.quant.fp8_activations`), each segment's columns of the output from one `matmul_kernel`."""
    rows = x.numel() // x.shape[-1]
    flat = weight.ordered_input(x).reshape(rows, x.shape[-1]).contiguous()
    values, scales = quantize_activations(flat)
    out = torch.empty(rows, weight.shape[0], device=x.device, dtype=x.dtype)
    steps = x.shape[-1] // BLOCK
    column = 0
    for qtype, data in weight.segments:
        if qtype != QTYPE:
            raise ValueError(f"fp8_activation_linear multiplies FP8_B128 blocks, not {qtype}")
        n = data.shape[0]
        grid = (triton.cdiv(rows, launch.block_m) * triton.cdiv(n, launch.block_n),)
        matmul_kernel[grid](
            values,
            scales,
            data,
            out[:, column : column + n],
            rows,
            n,
            steps,
            data.shape[1],
            out.stride(0),
            BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n,
            GROUP_M=launch.group_m,
            UNROLL=launch.unroll if steps % launch.unroll == 0 else 1,
            BLOCK_BYTES=BLOCK_BYTES,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )
        column += n
    return out.view(*x.shape[:-1], weight.shape[0])
