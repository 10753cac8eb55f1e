"""Triton SwiGLU activation: `silu(gate) * up` over the fused gate|up projection, with the signature,
semantics and rounding points of `deltaspec.ops.activation.silu_mul`."""

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl

BLOCK_COLS = 1024  # output columns per program


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    pdl.wait_for_previous()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    row_in = gate_up_ptr + row.to(tl.int64) * stride_in
    gate = tl.load(row_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> [..., I], rounded like `F.silu(gate) * up` in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    rows_in = gate_up.reshape(-1, 2 * inter) if gate_up.stride(-1) == 1 else gate_up.contiguous().view(-1, 2 * inter)
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows_out = out.view(-1, inter)  # [rows, I]
    grid = (rows_in.shape[0], triton.cdiv(inter, BLOCK_COLS))
    _silu_mul_kernel[grid](
        rows_in, rows_out, inter, rows_in.stride(0), rows_out.stride(0), BLOCK=BLOCK_COLS, num_warps=4, **pdl.LAUNCH
    )
    return out
