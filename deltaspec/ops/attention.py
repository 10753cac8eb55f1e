"""Attention over a paged KV cache (reference): write new rows, then causal attention per sequence.

Contract (kernels keep it): the cache of one layer is `k_cache`, `v_cache` [num_blocks,
block_size, Hkv, D]; row t is written at flat slot `slot_mapping[t]` (block * block_size +
offset). Sequence b (`layout`, `deltaspec.ops.layout`) has `query_lens[b]` new rows, the last
of its `context_lens[b]` cached tokens, its pages listed in `block_tables[b]`. Row i of sequence b
attends to cached positions 0 .. context_lens[b] - query_lens[b] + i (causal within the new rows),
with grouped-query heads
(query head h reads KV head h // (Hq / Hkv)). Softmax runs in float32 (float64 for float64).
Trees (`layout.tree`): row i of a speculative sequence whose rows branch sees the positions before the
sequence's first new row and, of its new rows, only those on its own path (`TreeRows.ancestors_t`: itself and
its ancestors); its KV still sits at position context_lens[b] - query_lens[b] + i.

A quantized cache (`--kv-cache-dtype fp8_e4m3` or `int8`) is a float8_e4m3fn or int8 tensor [num_blocks,
block_size, Hkv, D + 16]: each row (one token's one KV head) is its D values quantized with the row's own
scale, then that scale's 4 float32 bytes and 12 zero bytes, so that a row of D + 16 bytes (D a multiple of 16)
starts on a 16-byte boundary and kernels read it in 16-byte vectors. The scale is computed when the row is
written: amax / 448 (e4m3) or amax / 127 (int8) of the row's values in float32 (1 for an all-zero row); a value
is x / scale rounded to nearest (even), and reads back as stored * scale. A row's bytes depend on that row alone,
so a token's cached K and V are the same whichever pass wrote them (decode, verify, prefill chunk).
"""

import torch
import torch.nn.functional as F

from deltaspec.ops.layout import SeqLayout, ancestor_masks

SCALE_BYTES = 4  # a quantized row's float32 scale, first in its tail
ROW_TAIL_BYTES = 16  # after a quantized row's values: its scale, then zero bytes up to 16
QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}  # the largest stored magnitude per cache dtype


def kv_row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one cache row: D, or D values and the 16-byte tail holding the scale for a quantized cache."""
    return head_dim + ROW_TAIL_BYTES if cache_dtype in QUANT_MAX else head_dim


def quantize_kv_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] -> [..., D + 16] of `cache_dtype` (values, the scale's bytes, zeros) as the contract says."""
    rows = x.to(torch.float32)
    amax = rows.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / QUANT_MAX[cache_dtype], torch.ones_like(amax))
    scaled = rows / scale
    if cache_dtype == torch.int8:
        values = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp(-448, 448).to(torch.float8_e4m3fn)
    row = torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)  # [..., D + 4]
    return F.pad(row, (0, ROW_TAIL_BYTES - SCALE_BYTES)).view(cache_dtype)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., D + 16] of a quantized cache -> values [..., D] in `dtype` (stored * scale, exact in
    float32); rows of a float cache are only cast."""
    if rows.dtype not in QUANT_MAX:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - ROW_TAIL_BYTES
    values = rows[..., :head_dim].to(torch.float32)
    scale = rows[..., head_dim : head_dim + SCALE_BYTES].contiguous().view(torch.uint8).view(torch.float32)  # [..., 1]
    return (values * scale).to(dtype)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D (+ 16 quantized)]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    for x, cache in ((k, k_cache), (v, v_cache)):
        if cache.dtype in QUANT_MAX:  # copied as bytes (CPU torch copies no float8 by index)
            rows = quantize_kv_rows(x, cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        else:
            rows = x.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


def _pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The rows of `pages` of one layer's cache, flattened to [pages * block_size, Hkv, width] (gathered as
    bytes for a quantized cache)."""
    if cache.dtype in QUANT_MAX:
        return cache.view(torch.uint8)[pages].flatten(0, 1).view(cache.dtype)
    return cache[pages].flatten(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    layout: SeqLayout,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    block_tables = layout.block_tables.long()
    start, tree = 0, layout.tree
    for b, (q_len, ctx_len) in enumerate(zip(layout.query_lens, layout.context_lens)):
        pages = block_tables[b, : (ctx_len + block_size - 1) // block_size]
        keys = dequantize_kv_rows(_pages(k_cache, pages)[:ctx_len], q.dtype)  # [S, Hkv, D]
        values = dequantize_kv_rows(_pages(v_cache, pages)[:ctx_len], q.dtype)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [S, Hq, D]
        rows = q[start : start + q_len]  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", rows, keys) * scale  # [Hq, L, S]
        query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        allowed = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]  # [L, S]
        if tree is not None and layout.speculative[b]:
            masks = torch.tensor(ancestor_masks(tree.parents[b]), device=q.device)  # [L] int64
            allowed[:, ctx_len - q_len :] = ((masks[:, None] >> torch.arange(q_len, device=q.device)) & 1).bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=acc).to(q.dtype)
        out[start : start + q_len] = torch.einsum("hls,shd->lhd", probs, values)
        start += q_len
    return out
