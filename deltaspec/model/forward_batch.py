"""`ForwardBatch`: the flat tensors one forward pass runs on (built by the engine's runner).

Rows of all sequences lie back to back. Sequence b contributes `query_lens[b]` rows (a prompt
chunk, one decode row, or several verify rows) that continue its `context_lens[b] -
query_lens[b]` already-computed tokens. The lists are host copies the torch references loop
over; kernels read the device tensors.
"""

from dataclasses import dataclass

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
