"""Multimodal RoPE reference (Qwen3.5's interleaved M-RoPE): cos and sin from three position streams.

Each token has a temporal, a height and a width position (equal for text, different for image tokens). Frequency
pair i of the rotary half turns with the height stream when `i % 3 == 1` and `i < 3 * sections[1]`, with the width
stream when `i % 3 == 2` and `i < 3 * sections[2]`, and with the temporal stream otherwise, as transformers'
`Qwen3_5TextRotaryEmbedding` lays them out (released checkpoints: 64 rotary dims, sections (11, 11, 10)). With
equal streams this is `deltaspec.ops.rope.cos_sin`.
"""

import torch


def mrope_axes(pairs: int, sections: tuple[int, int, int]) -> torch.Tensor:
    """Which stream (0 temporal, 1 height, 2 width) turns each of the `pairs` frequency pairs.  # [pairs]"""
    i = torch.arange(pairs)
    height = (i % 3 == 1) & (i < 3 * sections[1])
    width = (i % 3 == 2) & (i < 3 * sections[2])
    return torch.where(height, 1, torch.where(width, 2, 0))


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` [3, T] (temporal, height, width) and `inv_freq` [R/2], each [T, R],
    computed in inv_freq's dtype and cast to `dtype`."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq  # [3, T, R/2]
    axes = mrope_axes(inv_freq.shape[0], sections).to(positions.device)
    chosen = freqs.gather(0, axes.expand(1, freqs.shape[1], -1))[0]  # [T, R/2]
    emb = torch.cat((chosen, chosen), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
