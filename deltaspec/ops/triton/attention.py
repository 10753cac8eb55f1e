"""Triton kernels for paged attention: `write_kv` and `paged_attention`, with the signatures and semantics of
`deltaspec.ops.attention` (the torch reference is the spec; read its docstring for the contract).

`write_kv` — one kernel writes the K and V rows of every token to their flat cache slots. Grid (T, Hkv). A row whose
`slot_mapping` is negative is skipped (padding rows of CUDA-graph buckets); the reference has no such rows.

`paged_attention` — flash attention with an online softmax (exp2, fp32 statistics) that walks each sequence's pages
through `block_tables`, one token's page looked up per KV position, so any page size (a power of two: 16, 32, 64)
and any tile width work together. One kernel, `_paged_attention_kernel`, serves both regimes; its M dimension is a
flat index over (row, query head) pairs of one sequence:

- decode / verify (`layout.max_query_len` <= VERIFY_MAX_ROWS): a program takes all `group` query heads of one KV
  head, M = rows x group (padded to a power of two, 16 <= BLOCK_M <= 64), so each K/V tile is read once per group.
  Grid (cdiv(max_query_len * group, BLOCK_M), num_seqs, Hkv * splits).
- prefill (longer chunks): a program takes BLOCK_M rows of one query head (128 for head_dim <= 128, 64 above).
  Grid (cdiv(max_query_len, BLOCK_M), num_seqs, Hq * splits). KV tiles past the row block's last allowed position
  are skipped; tiles every row of the block may fully see run without masks.

Split-KV (flash decoding): when the grid has too few programs to fill the device, each (row block, sequence, head)
program is split `kv_splits(...)` ways over the KV positions. The count depends on host constants only (the number
of sequences, `max_query_len`, head counts, the block table width, the SM count), never on context lengths, so a
captured CUDA graph stays valid while contexts grow (as long as its block table keeps its width): each split takes
its share of `context_lens_t[b]` in-kernel (a multiple of BLOCK_N), writes a normalised partial output and its
log2-sum-exp, and `_combine_splits_kernel` (grid (T, Hq)) merges them. With one split the attention kernel writes
the output directly.

Trees (`layout.tree`, compiled in with HAS_TREE; only its device tensors are read): a row of a speculative
sequence sees the positions before the sequence's first new row (`base` = context length - rows) and the new rows
whose bits its `ancestors_t` mask sets. Masked tiles test those bits; a speculative sequence's unmasked tiles end
at or before `base`, in both regimes and every split. Other sequences' rows stay causal.

Quantized caches (fp8 e4m3 or int8 rows [D values, float32 scale], `deltaspec.ops.attention`): `write_kv`
computes each row's scale and values as the reference does (correctly rounded divisions, ties to even), and the
attention kernel multiplies each K / V tile by its rows' scales before the dot products.

Everything per sequence (row starts, context lengths, pages) is read from the layout's device tensors; the wrappers
make no host syncs and no data-dependent allocations. Limits: q in fp16 / bf16 / fp32 (fp32 dots in IEEE
precision); head_dim any size up to 256 (padded to a power of two in registers; tested 64 to 256); Hq a multiple of
Hkv. Output rows that belong to no sequence (padding past `query_start[num_seqs]`) are left unwritten, as in the
reference. BLOCK_N is 64 for head_dim <= 128 and 32 above, num_warps 4 or 8 by tile size; these constants are first
guesses, to be tuned on the H200.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from deltaspec.ops.attention import QUANT_MAX
from deltaspec.ops.layout import SeqLayout
from deltaspec.ops.triton import pdl

VERIFY_MAX_ROWS = 64  # up to this many rows per sequence, a program takes all query heads of a KV head
MAX_KV_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # of the block tables' capacity, so short tables are not split into slivers
PROGRAMS_PER_SM = 2  # split until the grid has about this many programs per SM
H200_SM_COUNT = 132  # used off CUDA (Triton's interpreter), so tests there take the H200's split decisions


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    """Row (token, head) of K and V into its cache slot; with QUANT_MAX > 0 (a quantized cache) the row's values
    over its scale amax / QUANT_MAX, then the tail holding the scale's bytes after them."""
    pdl.wait_for_previous()
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    written = slot >= 0
    slot = tl.where(written, slot, 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM) & written
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + offs_d * stride_kd, mask=mask, other=0.0)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + offs_d * stride_vd, mask=mask, other=0.0)
    k_row = k_cache_ptr + page * stride_kcb + offset * stride_kcs + head * stride_kch
    v_row = v_cache_ptr + page * stride_vcb + offset * stride_vcs + head * stride_vch
    if QUANT_MAX > 0:
        _write_quantized_row(k_row, k, offs_d * stride_kcd, mask, written, HEAD_DIM * stride_kcd, QUANT_MAX)
        _write_quantized_row(v_row, v, offs_d * stride_vcd, mask, written, HEAD_DIM * stride_vcd, QUANT_MAX)
    else:
        tl.store(k_row + offs_d * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_row + offs_d * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_quantized_row(row_ptr, x, offsets, mask, written, scale_offset, QUANT_MAX: tl.constexpr):
    """x [BLOCK_D] (0 where masked) as a quantized cache row: x / scale rounded to nearest even (division
    correctly rounded, as torch divides) at `offsets`, then the row's 16-byte tail at byte `scale_offset`: the
    float32 scale = amax / QUANT_MAX (1 for a zero row) and three zero words."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, QUANT_MAX), 1.0)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QUANT_MAX), QUANT_MAX)
    if QUANT_MAX == 127.0:  # int8: 1.5 * 2**23 added and taken away rounds to an integer, ties to even
        scaled = (scaled + 12582912.0) - 12582912.0
    tl.store(row_ptr + offsets, scaled.to(row_ptr.dtype.element_ty), mask=mask)
    tail = tl.arange(0, 4)  # float32 words of the tail
    tail_words = tl.where(tail == 0, scale, 0.0)
    tl.store((row_ptr + scale_offset).to(tl.pointer_type(tl.float32)) + tail, tail_words, mask=written)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; rows with a negative slot are skipped
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        QUANT_MAX=QUANT_MAX.get(k_cache.dtype, 0.0),
        num_warps=1 if head_dim <= 256 else 2,  # one 16-byte vector of a bf16 row per thread
        **pdl.LAUNCH,
    )


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    start_n,
    kv_end,
    allowed_end,
    ancestors,
    tree_base,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    QUANTIZED: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    """One BLOCK_N-wide KV tile folded into the online softmax of the BLOCK_M query rows in `q`. MASKED tiles
    mask positions >= kv_end and, per row, positions >= allowed_end (causal); with HAS_TREE also a position
    n >= tree_base whose bit n - tree_base of the row's `ancestors` ([BLOCK_M] int64) is clear. Unmasked tiles
    lie wholly inside. QUANTIZED rows are read as their values times the float32 scale stored after them."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] KV positions
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    if MASKED:
        n_valid = offs_n < kv_end
        pages = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)  # [BLOCK_N]
        kv_mask = n_valid[:, None] & d_valid[None, :]
    else:
        pages = tl.load(table_ptr + offs_n // PAGE_SIZE).to(tl.int64)
        kv_mask = d_valid[None, :]
    in_page = offs_n % PAGE_SIZE
    k_rows = pages * stride_kcb + in_page * stride_kcs + kv_head * stride_kch  # [BLOCK_N]
    v_rows = pages * stride_vcb + in_page * stride_vcs + kv_head * stride_vch
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :] * stride_kcd, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vcd, mask=kv_mask, other=0.0)
    if QUANTIZED:
        k = _dequantized(k, k_cache_ptr, k_rows + HEAD_DIM * stride_kcd, offs_n < kv_end)
        v = _dequantized(v, v_cache_ptr, v_rows + HEAD_DIM * stride_vcd, offs_n < kv_end)
    k = k.to(q.dtype)  # [BLOCK_N, BLOCK_D]
    v = v.to(q.dtype)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        allowed = offs_n[None, :] < allowed_end[:, None]
        if HAS_TREE:
            new_row = offs_n - tree_base  # [BLOCK_N] position among the sequence's new rows (< 0: before them)
            bit = tl.minimum(tl.maximum(new_row, 0), 63).to(tl.int64)
            on_path = ((ancestors[:, None] >> bit[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
            allowed = allowed & ((new_row < 0)[None, :] | on_path)
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # [BLOCK_M]
    if MASKED:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet keep zero weight
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _dequantized(values, cache_ptr, scale_offsets, valid):
    """Quantized rows' values [BLOCK_N, BLOCK_D] times their float32 scales at byte offsets `scale_offsets`
    [BLOCK_N] of the cache (rows not `valid` read scale 0)."""
    scales = tl.load((cache_ptr + scale_offsets).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
    return values.to(tl.float32) * scales[:, None]


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_tables_ptr,
    speculative_ptr,
    ancestors_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_table,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    pdl.wait_for_previous()
    row_block = tl.program_id(0)
    seq = tl.program_id(1)
    head_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table

    flat = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (row, head) pairs
    rows = flat // HEADS_PER_PROGRAM
    heads = head_block * HEADS_PER_PROGRAM + flat % HEADS_PER_PROGRAM
    kv_head = (head_block * HEADS_PER_PROGRAM) // GROUP
    row_valid = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    token = (q_begin + rows).to(tl.int64)
    q_offsets = token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # KV range of this split, then the causal limits of this row block within it.
    first_row = (row_block * BLOCK_M) // HEADS_PER_PROGRAM
    last_row = tl.minimum((row_block * BLOCK_M + BLOCK_M - 1) // HEADS_PER_PROGRAM, q_len - 1)
    split_tokens = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = split * split_tokens
    split_hi = tl.minimum(split_lo + split_tokens, ctx)
    base = ctx - q_len  # position of the sequence's first new row
    allowed_end = base + rows + 1  # [BLOCK_M] first position a row may not see
    kv_hi = tl.minimum(base + last_row + 1, split_hi)
    kv_hi = tl.where(first_row < q_len, kv_hi, split_lo)
    if HAS_TREE:
        follows_tree = tl.load(speculative_ptr + seq) != 0
        ancestors = tl.load(ancestors_ptr + token, mask=row_valid & follows_tree, other=-1)  # [BLOCK_M] int64
        full_limit = tl.where(follows_tree, base, base + first_row + 1)  # a tree's rows need not see each other
    else:
        ancestors = tl.full([BLOCK_M], -1, tl.int64)  # every new row up to allowed_end
        full_limit = base + first_row + 1
    full_hi = tl.minimum(full_limit, kv_hi)  # every row of the block sees all before this
    full_end = split_lo + tl.maximum(full_hi - split_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(split_lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            start_n,
            kv_hi,
            allowed_end,
            ancestors,
            base,
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_kcd,
            stride_vcb,
            stride_vcs,
            stride_vch,
            stride_vcd,
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            PAGE_SIZE,
            DOT_PRECISION,
            MASKED=False,
            QUANTIZED=QUANTIZED,
            HAS_TREE=HAS_TREE,
        )
    for start_n in range(full_end, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            start_n,
            kv_hi,
            allowed_end,
            ancestors,
            base,
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_kcd,
            stride_vcb,
            stride_vcs,
            stride_vch,
            stride_vcd,
            qk_scale,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            PAGE_SIZE,
            DOT_PRECISION,
            MASKED=True,
            QUANTIZED=QUANTIZED,
            HAS_TREE=HAS_TREE,
        )

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out_offsets = token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_row = (token * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_M] into [T, Hq, NUM_SPLITS]
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the NUM_SPLITS partial outputs of one (row, head): weights exp2(lse_s - max lse)."""
    pdl.wait_for_previous()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part_row = (token * NUM_HEADS + head) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(part_lse_ptr + part_row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))  # [BLOCK_SPLITS]
    lse_max = tl.max(lse, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    total = tl.sum(tl.exp2(lse - lse_max), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_lse_ptr + part_row + split) - lse_max)
        partial = tl.load(part_out_ptr + (part_row + split) * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
        acc += weight * partial
    out = acc / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SM_COUNT


def _tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int, int, int]:
    """(heads per program, BLOCK_M, BLOCK_N, num_warps) of the regime `max_query_len` selects."""
    block_n = 64 if head_dim <= 128 else 32
    if max_query_len <= VERIFY_MAX_ROWS:
        block_m = min(max(16, triton.next_power_of_2(max_query_len * group)), 64)
        heads_per_program = group
    else:
        block_m = 128 if head_dim <= 128 else 64
        heads_per_program = 1
    num_warps = 8 if block_m * triton.next_power_of_2(head_dim) >= 16384 else 4
    return heads_per_program, block_m, block_n, num_warps


def kv_splits(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    layout: SeqLayout,
) -> int:
    """How many ways `paged_attention` splits each program's KV range; host constants only (CUDA-graph safe)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    heads_per_program, block_m, _, _ = _tiles(layout.max_query_len, num_heads // num_kv_heads, head_dim)
    row_blocks = triton.cdiv(layout.max_query_len * heads_per_program, block_m)
    programs = row_blocks * layout.num_seqs * (num_heads // heads_per_program)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(q.device), programs)
    capacity = min(layout.block_tables.shape[1], k_cache.shape[0]) * block_size
    return max(1, min(wanted, MAX_KV_SPLITS, triton.cdiv(capacity, MIN_TOKENS_PER_SPLIT)))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    heads_per_program, block_m, block_n, num_warps = _tiles(layout.max_query_len, group, head_dim)
    num_splits = kv_splits(q, k_cache, layout)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    tree = layout.tree
    tree_tensors = (layout.speculative_t, tree.ancestors_t) if tree is not None else (layout.query_start,) * 2
    grid = (
        triton.cdiv(layout.max_query_len * heads_per_program, block_m),
        layout.num_seqs,
        (num_heads // heads_per_program) * num_splits,
    )
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        layout.query_start,
        layout.context_lens_t,
        layout.block_tables,
        *tree_tensors,
        scale * math.log2(math.e),
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        layout.block_tables.stride(0),
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 q is not rounded to tf32
        QUANTIZED=k_cache.dtype in QUANT_MAX,
        HAS_TREE=tree is not None,
        num_warps=num_warps,
        **pdl.LAUNCH,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            *out.stride(),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            **pdl.LAUNCH,
        )
    return out
