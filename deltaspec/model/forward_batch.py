"""`ForwardBatch`: the flat tensors one forward pass runs on (built by the engine's runner).

Rows of all sequences lie back to back; `layout` (`deltaspec.ops.layout.SeqLayout`) says which
rows belong to which sequence, where each sequence's state and KV pages live, and which rows are
drafts being verified.
"""

from dataclasses import dataclass

import torch

from deltaspec.ops.layout import SeqLayout


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: KV cache slot of each row (-1: a padding row, written nowhere)
    layout: SeqLayout

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def last_row_indices(self) -> list[int]:
        """Index of each sequence's last row in this batch."""
        return [start + length - 1 for start, length in zip(self.layout.row_starts, self.layout.query_lens)]
