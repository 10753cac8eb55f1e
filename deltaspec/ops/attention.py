"""Attention over a paged KV cache (reference): write new rows, then causal attention per sequence.

Contract (kernels keep it): the cache of one layer is `k_cache`, `v_cache` [num_blocks,
block_size, Hkv, D]; row t is written at flat slot `slot_mapping[t]` (block * block_size +
offset). Sequence b (`layout`, `deltaspec.ops.layout`) has `query_lens[b]` new rows, the last
of its `context_lens[b]` cached tokens, its pages listed in `block_tables[b]`. Row i of sequence b
attends to cached positions 0 .. context_lens[b] - query_lens[b] + i (causal within the new rows),
with grouped-query heads
(query head h reads KV head h // (Hq / Hkv)). Softmax runs in float32 (float64 for float64).
"""

import torch

from deltaspec.ops.layout import SeqLayout


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    start = 0
    for b, (q_len, ctx_len) in enumerate(zip(layout.query_lens, layout.context_lens)):
        pages = block_tables[b, : (ctx_len + block_size - 1) // block_size]
        keys = k_cache[pages].flatten(0, 1)[:ctx_len].to(q.dtype).repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_cache[pages].flatten(0, 1)[:ctx_len].to(q.dtype).repeat_interleave(group, dim=1)
        rows = q[start : start + q_len]  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", rows, keys) * scale  # [Hq, L, S]
        query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        allowed = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=acc).to(q.dtype)
        out[start : start + q_len] = torch.einsum("hls,shd->lhd", probs, values)
        start += q_len
    return out
