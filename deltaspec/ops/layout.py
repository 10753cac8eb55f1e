"""`SeqLayout`: how the rows of one forward pass split into sequences — the contract every op with
per-sequence state (conv window, GDN state, paged attention) reads.

Rows of all sequences lie back to back; sequence b owns rows `query_start[b] : query_start[b+1]`
(`query_lens[b]` of them), which are the last of its `context_lens[b]` tokens. Its GDN state and
conv window live at slot `slots[b]`; its KV pages are `block_tables[b]`. `speculative[b]` marks
rows being verified (logged, state not advanced) and `fold[b]` the accepted log rows of its
previous verify pass to replay first (see `deltaspec.ops.gdn`).

The layout is held twice: host lists, which the torch references loop over, and device tensors,
which kernels read. A CUDA graph replays with new device tensors but the host values of its
capture, so a kernel may take only the bucket-constant host values — the number of sequences and
`max_query_len` — and must read everything else from the device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqLayout:
    query_lens: list[int]
    context_lens: list[int]
    slots: list[int]
    fold: list[int]
    speculative: list[bool]
    max_query_len: int
    query_start: torch.Tensor  # [B + 1] int32: first row of each sequence, then the row count
    context_lens_t: torch.Tensor  # [B] int32
    slots_t: torch.Tensor  # [B] int64
    fold_t: torch.Tensor  # [B] int32
    speculative_t: torch.Tensor  # [B] int32 (0 or 1)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # per-pass tensors every layer shares

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slots: list[int],
        device: torch.device | str,
        fold: list[int] | None = None,
        speculative: list[bool] | None = None,
        block_tables: list[list[int]] | None = None,
    ) -> SeqLayout:
        """A layout from host values; device tensors are made on `device`."""
        fold = list(fold) if fold else [0] * len(query_lens)
        speculative = [bool(s) for s in speculative] if speculative else [False] * len(query_lens)
        tables = block_tables or [[0]] * len(query_lens)
        width = max(len(t) for t in tables)
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)

        def int32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            list(query_lens),
            list(context_lens),
            list(slots),
            fold,
            speculative,
            max(query_lens),
            int32(starts),
            int32(context_lens),
            torch.tensor(slots, dtype=torch.long, device=device),
            int32(fold),
            int32([int(s) for s in speculative]),
            int32([t + [0] * (width - len(t)) for t in tables]),
        )

    @property
    def row_starts(self) -> list[int]:
        """First row of each sequence (host)."""
        starts, total = [], 0
        for length in self.query_lens:
            starts.append(total)
            total += length
        return starts

    def query_start_long(self) -> torch.Tensor:  # [B + 1] int64
        """`query_start` as int64 (what fla's varlen kernels take), made once per pass and shared by the layers."""
        if "query_start_long" not in self.derived:
            self.derived["query_start_long"] = self.query_start.long()
        return self.derived["query_start_long"]

    def chunk_indices(self, chunk_size: int) -> torch.Tensor:  # [num_chunks, 2] int64
        """For each chunk of `chunk_size` rows, sequence by sequence (a sequence's last chunk may be short): the
        sequence and the chunk's index within it — fla's `prepare_chunk_indices`. Built from the host lists and
        uploaded from pinned memory without waiting for the device (a pageable upload synchronizes the stream),
        once per pass and chunk size."""
        key = ("chunk_indices", chunk_size)
        if key not in self.derived:
            pairs = [
                (seq, chunk) for seq, rows in enumerate(self.query_lens) for chunk in range(-(-rows // chunk_size))
            ]
            host = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
            if self.query_start.device.type == "cuda":
                host = host.pin_memory()
            self.derived[key] = host.to(self.query_start.device, non_blocking=True)
        return self.derived[key]
