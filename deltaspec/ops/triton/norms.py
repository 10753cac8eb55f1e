"""Triton RMSNorm kernels: the zero-centred block norm (alone and fused with the residual add) and the
gated per-head norm of GDN, with the signatures, semantics and rounding points of `deltaspec.ops.norms`.

Every input is viewed as rows of its last dim; a program normalises a tile of BLOCK_ROWS rows of
BLOCK_D (the next power of two of the last dim) elements in float32. Float64 inputs are computed in
float32 here (the reference keeps float64; float64 runs use the reference).
"""

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl

TILE_ELEMENTS = 4096  # elements per program when rows are short (head norms): several rows per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, n_rows, dim, stride_x, stride_out, eps, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    pdl.wait_for_previous()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)  # [BLOCK_ROWS, BLOCK_D]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_ROWS]
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)  # [BLOCK_D]
    out = x * rstd[:, None] * (1.0 + weight[None, :])
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    total_ptr,
    n_rows,
    dim,
    stride_x,
    stride_residual,
    stride_out,
    stride_total,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pdl.wait_for_previous()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)  # [BLOCK_ROWS, BLOCK_D]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    total = (residual + x).to(total_ptr.dtype.element_ty)  # the sum rounds to x's dtype, as in torch
    tl.store(total_ptr + rows[:, None] * stride_total + cols[None, :], total, mask=mask)
    total = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(total * total, axis=1) / dim + eps)  # [BLOCK_ROWS]
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)  # [BLOCK_D]
    out = total * rstd[:, None] * (1.0 + weight[None, :])
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    n_rows,
    dim,
    stride_x,
    stride_gate,
    stride_out,
    eps,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pdl.wait_for_previous()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)  # [BLOCK_ROWS, BLOCK_D]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_ROWS]
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)  # [BLOCK_D]
    weighted = weight[None, :] * normed
    if ROUND_PRODUCT:  # weight * normed happens in x's 16-bit dtype in the reference
        weighted = weighted.to(out_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = weighted * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` [..., D] as [rows, D] with a unit stride along D (a view where possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _launch_shape(n_rows: int, dim: int) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK_ROWS, BLOCK_D, num_warps) for `n_rows` rows of `dim` elements."""
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, TILE_ELEMENTS // block_d)
    num_warps = 8 if block_rows * block_d >= 8192 else 4
    return (triton.cdiv(n_rows, block_rows),), block_rows, block_d, num_warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)` over the last dim of x [..., D]."""
    rows_in = _as_rows(x)  # [rows, D]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows_out = out.view(-1, x.shape[-1])  # [rows, D]
    n_rows, dim = rows_in.shape
    grid, block_rows, block_d, num_warps = _launch_shape(n_rows, dim)
    _rms_norm_kernel[grid](
        rows_in,
        weight,
        rows_out,
        n_rows,
        dim,
        rows_in.stride(0),
        rows_out.stride(0),
        eps,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = residual + x` (rounded to x's dtype); returns (rms_norm(s), s). Reads x and residual once."""
    x_rows = _as_rows(x)  # [rows, D]
    residual_rows = _as_rows(residual)  # [rows, D]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows, total_rows = out.view(-1, x.shape[-1]), total.view(-1, x.shape[-1])  # [rows, D] each
    n_rows, dim = x_rows.shape
    grid, block_rows, block_d, num_warps = _launch_shape(n_rows, dim)
    _add_rms_norm_kernel[grid](
        x_rows,
        residual_rows,
        weight,
        out_rows,
        total_rows,
        n_rows,
        dim,
        x_rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        total_rows.stride(0),
        eps,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out, total


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm per head: `w * norm(x) * silu(gate)` over the last dim (Dv) of x, gate [..., Dv]."""
    x_rows = _as_rows(x)  # [rows, Dv]
    gate_rows = _as_rows(gate)  # [rows, Dv]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, x.shape[-1])  # [rows, Dv]
    n_rows, dim = x_rows.shape
    round_product = torch.promote_types(weight.dtype, x.dtype).itemsize == 2
    grid, block_rows, block_d, num_warps = _launch_shape(n_rows, dim)
    _gated_rms_norm_kernel[grid](
        x_rows,
        gate_rows,
        weight,
        out_rows,
        n_rows,
        dim,
        x_rows.stride(0),
        gate_rows.stride(0),
        out_rows.stride(0),
        eps,
        ROUND_PRODUCT=round_product,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    return out
