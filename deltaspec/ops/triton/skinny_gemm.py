"""Skinny GEMM: `x @ weight.T` for a few rows (1..64) against a large weight, a memory-bound product.

Each weight element is read once: programs tile N by BLOCK_N and (with split-K) K into SPLIT_K
slices, each program streaming its [BLOCK_N, K / SPLIT_K] slab of the weight in [BLOCK_N, BLOCK_K]
tiles (the tile count is a compile-time constant: one compilation per weight shape). Two inner
products:
- "dot": tensor cores on `weight_tile @ x_tile.T` (N takes the MMA's wide side, the rows are padded
  to BLOCK_M >= 16),
- "fma": broadcast-multiply-reduce on CUDA cores, for a handful of rows.
Split-K writes fp32 partial sums to a workspace [SPLIT_K, M, N] that a second kernel adds in a
fixed order (deterministic). Accumulation is fp32; the output has x's dtype.

`SKINNY_CONFIGS` is the set the routing table (`deltaspec.ops.gemm_routing`) measures per shape and
row count; `skinny_linear(x, weight, config)` runs one of them.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaspec.ops.triton import pdl

MAX_ROWS = 64
REDUCE_BLOCK = 1024  # elements per program of the split-K reduction


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration. `max_rows`: the most rows it handles (the fma product keeps a
    [rows, BLOCK_N, BLOCK_K] product in registers, so it is only offered for a few rows)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    use_dot: bool
    num_stages: int = 3
    max_rows: int = MAX_ROWS

    @property
    def name(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        return f"{kind}-n{self.block_n}-k{self.block_k}-s{self.split_k}-w{self.num_warps}-p{self.num_stages}"

    def block_m(self, rows: int) -> int:
        """Rows padded to a power of two (at least 16 for tensor cores)."""
        padded = triton.next_power_of_2(rows)
        return max(16, padded) if self.use_dot else padded


SKINNY_CONFIGS: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, use_dot=True, num_stages=4),
    SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=4, use_dot=True, num_stages=3),
    SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=4, use_dot=True, num_stages=3),
    SkinnyConfig(block_n=32, block_k=256, split_k=1, num_warps=4, use_dot=True, num_stages=4),
    SkinnyConfig(block_n=64, block_k=128, split_k=2, num_warps=4, use_dot=True, num_stages=4),
    SkinnyConfig(block_n=64, block_k=128, split_k=4, num_warps=4, use_dot=True, num_stages=4),
    SkinnyConfig(block_n=128, block_k=128, split_k=4, num_warps=8, use_dot=True, num_stages=3),
    SkinnyConfig(block_n=16, block_k=256, split_k=1, num_warps=4, use_dot=False, max_rows=4),
    SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, use_dot=False, max_rows=4),
    SkinnyConfig(block_n=16, block_k=256, split_k=4, num_warps=4, use_dot=False, max_rows=4),
    SkinnyConfig(block_n=8, block_k=512, split_k=1, num_warps=4, use_dot=False, max_rows=2),
)
CONFIGS_BY_NAME = {config.name: config for config in SKINNY_CONFIGS}


def configs_for(rows: int) -> tuple[SkinnyConfig, ...]:
    """The configurations that handle `rows` rows (and therefore every smaller row count)."""
    return tuple(config for config in SKINNY_CONFIGS if rows <= config.max_rows)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_split,
    K_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pdl.wait_for_previous()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_start = pid_k * (K_TILES * BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[:, None] < N
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(K_TILES):
        ks = k_start + k_tile * BLOCK_K + offs_k  # [BLOCK_K]
        k_mask = ks[None, :] < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask & k_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + ks[None, :], mask=n_mask & k_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision="ieee")  # [BLOCK_N, BLOCK_M]
        else:
            product = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
            acc += tl.sum(product, axis=2)
    out_base = out_ptr + pid_k * stride_split
    if USE_DOT:
        out_ptrs = out_base + offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
        out_mask = (offs_m[None, :] < M) & n_mask
    else:
        out_ptrs = out_base + offs_m[:, None] * stride_om + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        out_mask = m_mask & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    pdl.wait_for_previous()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig = SKINNY_CONFIGS[0]) -> torch.Tensor:
    """`x @ weight.T` for x [M, K] (M <= config.max_rows) and weight [N, K] with a unit stride along K;
    fp32 accumulation, output [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    k_tiles_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    target = (
        out if config.split_k == 1 else torch.empty((config.split_k, rows, n), dtype=torch.float32, device=x.device)
    )
    _skinny_kernel[grid](
        x,
        weight,
        target,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        rows * n,
        K_TILES=k_tiles_per_split,
        BLOCK_M=config.block_m(rows),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=config.use_dot,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.LAUNCH,
    )
    if config.split_k > 1:
        _split_k_reduce_kernel[(triton.cdiv(rows * n, REDUCE_BLOCK),)](
            target, out, rows * n, SPLIT_K=config.split_k, BLOCK=REDUCE_BLOCK, num_warps=4, **pdl.LAUNCH
        )
    return out
