"""`ForwardBatch`: the flat tensors one forward pass runs on (built by the engine's runner).

Rows of all sequences lie back to back; `layout` (`deltaspec.ops.layout.SeqLayout`) says which
rows belong to which sequence, where each sequence's state and KV pages live, and which rows are
drafts being verified.
"""

from dataclasses import dataclass

import torch

from deltaspec.ops.layout import SeqLayout


@dataclass
class ImageRows:
    """What a pass over image tokens adds: every row's three RoPE position streams (`deltaspec.ops.mrope`) and the
    vision tower's embeddings of the rows that are image tokens, which replace their token embeddings."""

    positions: torch.Tensor  # [3, T] long: temporal, height, width (equal for text rows)
    sections: tuple[int, int, int]  # the text model's M-RoPE sections
    rows: torch.Tensor  # [N] long: the image-token rows
    embeds: torch.Tensor  # [N, hidden]: their embeddings


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long: RoPE positions (the temporal stream, with images)
    slot_mapping: torch.Tensor  # [T] long: KV cache slot of each row (-1: a padding row, written nowhere)
    layout: SeqLayout
    images: ImageRows | None = None  # a pass over image tokens: their embeddings and the three position streams

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def last_row_indices(self) -> list[int]:
        """Index of each sequence's last row in this batch."""
        return [start + length - 1 for start, length in zip(self.layout.row_starts, self.layout.query_lens)]
