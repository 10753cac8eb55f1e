"""What each image's patch grid (t, h, w) fixes before any weight is read, as transformers computes it.

A grid counts patches: `t` temporal patches (1 for an image), `h` x `w` spatial ones, both multiples of the merge
size `m`. The tower sees a grid's patches in merge-block order: block row, block column, then the m x m patches of
the block in raster order, so every m x m block the merger joins is m^2 consecutive rows.
"""

from __future__ import annotations

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches


def merged_tokens(grid: Grid, merge: int) -> int:
    """How many embeddings (and so image tokens of the prompt) the tower gives for `grid`."""
    t, h, w = grid
    return t * h * w // (merge * merge)


def frame_lengths(grids: list[Grid]) -> list[int]:
    """The rows of each attention segment: one per temporal patch of each grid, `h * w` rows each (attention
    never crosses images or frames)."""
    return [h * w for t, h, w in grids for _ in range(t)]


def _block_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of one frame, in merge-block order.  # [h * w] each"""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def rotary_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """The (row, column) of every patch, the two positions of the tower's 2-D rotary embedding.  # [N, 2]"""
    parts = []
    for t, h, w in grids:
        rows, cols = _block_order(h, w, merge)
        parts.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(parts)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners) from `size` target points into a `side`-long table: floor and floor + 1
    (clamped), with their weights, in float32 as transformers computes them.  # [n, 2] each"""
    source = index.to(torch.float32) * (side - 1) / torch.full(index.shape, max(size - 1, 1))  # elementwise, as theirs
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grids: list[Grid], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned position table is `side` x `side`; each patch's embedding is the table resampled bilinearly
    (align_corners) to its grid's h x w: four rows of the table and their float32 weights per patch.
    # indices [N, 4] (into the flattened table), weights [N, 4]"""
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = _block_order(h, w, merge)
        row_taps, row_weights = _axis_taps(rows, h, side)
        col_taps, col_weights = _axis_taps(cols, w, side)
        indices.append((row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)
