"""Triton GDN gates with the signature and semantics of `deltaspec.ops.gdn.gdn_gates`: one launch, one
program per row, L2-normalises that row's q (times Dk^-0.5) and k heads and computes its decays
`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)`.

q and k may be strided views (the conv output split along channels); a and b may be too.
"""

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl

L2_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's softplus returns x itself above this


@triton.jit
def _l2_normalised(ptr, stride_t, stride_h, row, heads, dims, mask, scale):
    """Rows of [H, D] heads at `row`, each scaled to unit L2 norm (eps inside the root) times `scale`."""
    x = tl.load(ptr + row * stride_t + heads[:, None] * stride_h + dims[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [BH, BD]
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + L2_EPS)[:, None] * scale


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) as torch computes it, with log1p written out: exact for tiny exp(x)."""
    e = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    u = 1.0 + e
    rounded = u == 1.0  # e below half an ulp of 1: log1p(e) = e
    log1p = tl.where(rounded, e, tl.log(u) * (e / tl.where(rounded, 1.0, u - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def _gates_kernel(
    q_ptr,
    k_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    q_out_ptr,
    k_out_ptr,
    g_out_ptr,
    beta_out_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    a_stride_t,
    b_stride_t,
    HK: tl.constexpr,
    DK: tl.constexpr,
    HV: tl.constexpr,
    BHK: tl.constexpr,
    BDK: tl.constexpr,
    BHV: tl.constexpr,
    SCALE: tl.constexpr,
):
    pdl.wait_for_previous()
    row = tl.program_id(0).to(tl.int64)
    key_heads = tl.arange(0, BHK)
    dims = tl.arange(0, BDK)
    key_mask = (key_heads < HK)[:, None] & (dims < DK)[None, :]  # [BHK, BDK]
    out_offsets = row * HK * DK + key_heads[:, None] * DK + dims[None, :]  # outputs are contiguous [T, Hk, Dk]
    q = _l2_normalised(q_ptr, q_stride_t, q_stride_h, row, key_heads, dims, key_mask, SCALE)
    tl.store(q_out_ptr + out_offsets, q, mask=key_mask)
    k = _l2_normalised(k_ptr, k_stride_t, k_stride_h, row, key_heads, dims, key_mask, 1.0)
    tl.store(k_out_ptr + out_offsets, k, mask=key_mask)

    value_heads = tl.arange(0, BHV)
    value_mask = value_heads < HV
    a = tl.load(a_ptr + row * a_stride_t + value_heads, mask=value_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + value_heads, mask=value_mask, other=0.0).to(tl.float32)
    A_log = tl.load(A_log_ptr + value_heads, mask=value_mask, other=0.0).to(tl.float32)
    g = -tl.exp(A_log) * _softplus(a + dt_bias)  # [BHV]
    tl.store(g_out_ptr + row * HV + value_heads, g, mask=value_mask)
    b = tl.load(b_ptr + row * b_stride_t + value_heads, mask=value_mask, other=0.0).to(tl.float32)
    tl.store(beta_out_ptr + row * HV + value_heads, tl.sigmoid(b).to(beta_out_ptr.dtype.element_ty), mask=value_mask)


def gdn_gates(
    q: torch.Tensor,  # [T, Hk, Dk] post-conv
    k: torch.Tensor,  # [T, Hk, Dk] post-conv
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (q, k, g) in float32 and beta in b's dtype: [T, Hk, Dk], [T, Hk, Dk], [T, Hv], [T, Hv]."""
    num_tokens, num_key_heads, key_dim = q.shape
    num_value_heads = a.shape[1]
    assert k.shape == q.shape and b.shape == a.shape
    assert all(t.stride(-1) == 1 for t in (q, k, a, b)) and A_log.is_contiguous() and dt_bias.is_contiguous()
    q_out = torch.empty((num_tokens, num_key_heads, key_dim), dtype=torch.float32, device=q.device)
    k_out = torch.empty_like(q_out)
    g = torch.empty((num_tokens, num_value_heads), dtype=torch.float32, device=q.device)
    beta = torch.empty((num_tokens, num_value_heads), dtype=b.dtype, device=q.device)
    if num_tokens:
        _gates_kernel[(num_tokens,)](
            q,
            k,
            a,
            b,
            A_log,
            dt_bias,
            q_out,
            k_out,
            g,
            beta,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            a.stride(0),
            b.stride(0),
            HK=num_key_heads,
            DK=key_dim,
            HV=num_value_heads,
            BHK=triton.next_power_of_2(num_key_heads),
            BDK=triton.next_power_of_2(key_dim),
            BHV=triton.next_power_of_2(num_value_heads),
            SCALE=key_dim**-0.5,
            **pdl.LAUNCH,
        )
    return q_out, k_out, g, beta
