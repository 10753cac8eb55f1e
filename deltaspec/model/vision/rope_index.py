"""The text model's three position streams for a prompt with images, as transformers' `get_rope_index` gives them.

Text tokens advance one position on all three streams. An image's `t x (h/m) x (w/m)` placeholder tokens (one run
of the image token, its grid in merge units) all start at the position `p` that follows the text before them:
token (i, j, k) gets `(p + i, p + j, p + k)`. The text after the image starts at `p + max(h, w) / m`. After the
prompt, token number `n` (counted from 0, the prompt included) sits at `n + delta` on all three streams, `delta`
being the prompt's largest position + 1 - its length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.grid import Grid, merged_tokens


def expand_image_tokens(token_ids: Sequence[int], grids: list[Grid], image_token_id: int, merge: int) -> list[int]:
    """The prompt with its i-th image token repeated as many times as image i has embeddings (what the
    checkpoint's processor does to the chat template's one `<|image_pad|>` per image)."""
    count = sum(1 for token in token_ids if token == image_token_id)
    if count != len(grids):
        raise DeltaspecError(f"The prompt has {count} image placeholders for {len(grids)} images; give one per image.")
    out: list[int] = []
    images = iter(grids)
    for token in token_ids:
        out.extend([token] * merged_tokens(next(images), merge) if token == image_token_id else [token])
    return out


def _image_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive image tokens."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def mrope_positions(
    token_ids: Sequence[int], grids: list[Grid], image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """The (temporal, height, width) positions of every prompt token and the prompt's rope delta; the prompt holds
    each image as one run of image tokens, expanded (`expand_image_tokens`).  # positions [3, len(token_ids)]"""
    runs = _image_runs(token_ids, image_token_id)
    if len(runs) != len(grids):
        raise DeltaspecError(f"The prompt has {len(runs)} runs of image tokens for {len(grids)} images; give one each.")
    parts, current, text_start = [], 0, 0
    for (start, end), (t, h, w) in zip(runs, grids, strict=True):
        if end - start != merged_tokens((t, h, w), merge):
            raise DeltaspecError(
                f"An image of {merged_tokens((t, h, w), merge)} embeddings has {end - start} image tokens in the "
                "prompt; expand each placeholder to its image's size."
            )
        parts.append(torch.arange(start - text_start).expand(3, -1) + current)
        current += start - text_start
        grid = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        parts.append(torch.stack(grid).reshape(3, -1) + current)
        current += max(h, w) // merge
        text_start = end
    parts.append(torch.arange(len(token_ids) - text_start).expand(3, -1) + current)
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - len(token_ids) if len(token_ids) else 0
    return positions, delta
