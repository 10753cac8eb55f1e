"""`ForwardBatch`: the flat tensors one forward pass runs on (built by the engine's runner).

Rows of all sequences lie back to back. Sequence b contributes `query_lens[b]` rows (a prompt
chunk, one decode row, or 1 + k verify rows) that continue its `context_lens[b] -
query_lens[b]` already-computed tokens. Verify rows are `speculative`: GDN layers log them
instead of advancing the state, and `fold` says how many logged rows of the previous verify pass
were accepted (see `deltaspec.ops.gdn`). The lists are host copies the torch references loop
over; kernels read the device tensors.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: KV cache slot of each row
    block_tables: torch.Tensor  # [B, max_blocks] long (padded with 0)
    state_slots: torch.Tensor  # [B] long: GDN state slot of each sequence
    query_lens: list[int]
    context_lens: list[int]
    state_slot_list: list[int]
    fold: list[int] = field(default_factory=list)  # per sequence: accepted replay-log rows to fold first
    speculative: list[bool] = field(default_factory=list)  # per sequence: rows are drafts being verified

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def last_row_indices(self) -> list[int]:
        """Index of each sequence's last row in this batch."""
        ends, total = [], 0
        for length in self.query_lens:
            total += length
            ends.append(total - 1)
        return ends
