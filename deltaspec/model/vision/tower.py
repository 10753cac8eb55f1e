"""The vision tower of Qwen3.5 checkpoints (transformers' `Qwen3_5VisionModel`), written from its math.

For the patches of a batch of images (`pixels` [N, C * Tp * P * P], each image's rows in its grid's merge-block
order, `deltaspec.model.vision.grid`):

1. patch embedding: a 3-D convolution whose stride equals its kernel (Tp x P x P), i.e. one linear map of each
   flattened patch, plus bias;
2. plus the learned position table (`side` x `side` rows) resampled bilinearly to the image's grid;
3. `depth` pre-norm ViT blocks: `x += proj(attn(norm1(x)))`, `x += fc2(gelu_tanh(fc1(norm2(x))))`, LayerNorms
   with bias, attention bidirectional within each frame of each image, q and k turned by the 2-D (row, column)
   rotary embedding (`deltaspec.ops.vision`);
4. the merger: LayerNorm, then each m x m block of patches (m^2 consecutive rows) concatenated into one row,
   `fc2(gelu(fc1(.)))` (exact GELU) to the text model's hidden size.

Parameter names are the checkpoint's without its `model.visual.` prefix, so loading is a name lookup. Qwen3.5
has no deepstack outputs (Qwen3-VL's taps of intermediate blocks): the merger's output is the tower's only one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaspec.model.vision.config import VisionConfig
from deltaspec.model.vision.grid import Grid, frame_lengths, position_taps, rotary_positions
from deltaspec.ops.norms import compute_dtype
from deltaspec.ops.rope import inv_frequencies
from deltaspec.ops.vision import axial_cos_sin, frame_attention, layer_norm, rope_in_compute_dtype


class Affine(nn.Module):
    """`x @ weight.T + bias`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class PatchConv(nn.Module):
    """The patch embedding's convolution, its weight kept in the checkpoint's shape [hidden, C, Tp, P, P]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        self.weight = nn.Parameter(torch.empty(config.hidden_size, config.in_channels, tp, p, p), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C * Tp * P * P] -> [N, hidden] (the kernel covers the whole patch: one product)."""
        return F.linear(pixels, self.weight.reshape(self.weight.shape[0], -1), self.bias)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = PatchConv(config)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.qkv = Affine(config.hidden_size, 3 * config.hidden_size)
        self.proj = Affine(config.hidden_size, config.hidden_size)
        self.num_heads = config.num_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        q, k = rope_in_compute_dtype(q, cos, sin), rope_in_compute_dtype(k, cos, sin)
        return self.proj(frame_attention(q, k, v, lengths))


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = Affine(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = Affine(config.intermediate_size, config.hidden_size)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.linear_fc1 = Affine(merged, merged)
        self.linear_fc2 = Affine(merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.linear_fc1.weight.shape[1])  # [N / m^2, hidden * m^2]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """Image patches -> one text-model embedding per m x m block of patches."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        with torch.device("meta"):
            self.patch_embed = PatchEmbed(config)
            self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size).requires_grad_(False)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
            self.merger = Merger(config)
        inv_freq = inv_frequencies(config.head_dim // 2, config.rope_theta, compute_dtype(dtype), device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels [N, C * Tp * P * P] of `grids`' images back to back -> [N / m^2, out_hidden_size]."""
        merge, device = self.config.spatial_merge_size, self.inv_freq.device
        rows = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (rows, self.config.patch_dim) or any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"pixels {list(pixels.shape)} do not hold the patches of grids {grids}")
        x = self.patch_embed.proj(pixels.to(device=device, dtype=self.dtype))
        indices, weights = position_taps(grids, self.config.position_side, merge)
        table = self.pos_embed.weight[indices.to(device)]  # [N, 4, hidden]
        x = x + (table * weights.to(device)[..., None]).sum(1).to(self.dtype)  # weights stay float32, as theirs
        cos, sin = axial_cos_sin(rotary_positions(grids, merge).to(device), self.inv_freq)
        lengths = frame_lengths(grids)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
