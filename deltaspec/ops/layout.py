"""`SeqLayout`: how the rows of one forward pass split into sequences — the contract every op with
per-sequence state (conv window, GDN state, paged attention) reads.

Rows of all sequences lie back to back; sequence b owns rows `query_start[b] : query_start[b+1]`
(`query_lens[b]` of them), which are the last of its `context_lens[b]` tokens. Its GDN state and
conv window live at slot `slots[b]`; its KV pages are `block_tables[b]`. `speculative[b]` marks
rows being verified (logged, state not advanced) and `fold[b]` the accepted log rows of its
previous verify pass to replay first (see `deltaspec.ops.gdn`).

A pass in which some sequence verifies a tree of drafts, or folds the accepted path of one, also carries
`tree` (`TreeRows`): each row's parent row within its sequence, and the log rows each fold replays. Without it
every sequence's rows form a chain (row i follows row i - 1) and a fold replays log rows 0..fold-1.

The layout is held twice: host lists, which the torch references loop over, and device tensors,
which kernels read. A CUDA graph replays with new device tensors but the host values of its
capture, so a kernel may take only the bucket-constant host values — the number of sequences and
`max_query_len` — and must read everything else from the device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaspec.config.engine import MAX_TREE_ROWS

TREE_KEEP = 1  # recurrence hint: the row has children, so the state after it is the one the next row continues
TREE_RESTART = 2  # recurrence hint: the row's parent is not the state held after the previous row


def chain_parents(rows: int) -> list[int]:
    """The parents of a chain of `rows` rows: row i follows row i - 1, the first row the sequence's context."""
    return list(range(-1, rows - 1))


def ancestor_masks(parents: list[int]) -> list[int]:
    """Per row, the bits of its own row and of its ancestors' rows (int64 bit patterns, bit 63 as the sign)."""
    masks: list[int] = []
    for row, parent in enumerate(parents):
        bits = (1 << row) | (masks[parent] if parent >= 0 else 0)
        masks.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return masks


def recurrence_flags(parents: list[int]) -> list[int]:
    """Per row, what a recurrence that runs the rows in order with one running state does (`TREE_KEEP`,
    `TREE_RESTART`): after a row with children it holds that row's state; after a leaf it still holds the leaf's
    parent's; a row whose parent is not what it holds restarts from the folded state along its ancestors."""
    has_children = {p for p in parents if p >= 0}
    flags, held = [], -1  # held: the row whose state the recurrence holds (-1: the state before the first row)
    for row, parent in enumerate(parents):
        flag = TREE_RESTART if parent != held else 0
        if row in has_children:
            flag |= TREE_KEEP
            held = row
        else:
            held = parent
        flags.append(flag)
    return flags


def check_parents(parents: list[int]) -> None:
    """A tree's rows in order: the first row is the root (parent -1), every other row's parent comes before it."""
    if not parents or parents[0] != -1 or any(not 0 <= p < row for row, p in enumerate(parents) if row):
        raise ValueError(f"tree parents must start with -1 and point to earlier rows, got {parents}")
    if len(parents) > MAX_TREE_ROWS:
        raise ValueError(f"a tree has at most {MAX_TREE_ROWS} rows, got {len(parents)}")


@dataclass
class TreeRows:
    """The tree structure of one pass (DESIGN §5, trees). Rows of sequence b are a tree: `parents[b][i]` is row i's
    parent row within the sequence (-1 for its first row, the root; parents come before their children). Only a
    speculative sequence's rows may branch; any other sequence's are a chain. A speculative sequence's row i sees,
    in attention, the context before its first row and the rows on its own path (itself and its ancestors); its
    GDN recurrence and conv window continue from its parent's. Row i still writes its KV slot and its log row i.

    `fold_rows[b]` are the log rows sequence b's fold replays, in order (`fold[b]` of them): the accepted path of
    its last tree, or 0..fold-1 after a chain.

    Device tensors for the kernels: `parent_t` [T] int32, `ancestors_t` [T] int64 (bit j: row j of the same
    sequence is the row or one of its ancestors), `flags_t` [T] int32 (`recurrence_flags`), `fold_rows_t` [B, L]
    int32 (L = the log's rows; entries past fold[b] are 0)."""

    parents: list[list[int]]
    fold_rows: list[list[int]]
    parent_t: torch.Tensor
    ancestors_t: torch.Tensor
    flags_t: torch.Tensor
    fold_rows_t: torch.Tensor

    @classmethod
    def build(
        cls,
        parents: list[list[int]],
        fold_rows: list[list[int]],
        log_rows: int,
        device: torch.device | str,
    ) -> TreeRows:
        for rows in parents:
            if rows != chain_parents(len(rows)):
                check_parents(rows)
        width = max([log_rows, 1, *(len(f) for f in fold_rows)])
        flat = [p for rows in parents for p in rows]
        return cls(
            [list(p) for p in parents],
            [list(f) for f in fold_rows],
            torch.tensor(flat, dtype=torch.int32, device=device),
            torch.tensor([m for rows in parents for m in ancestor_masks(rows)], dtype=torch.long, device=device),
            torch.tensor([f for rows in parents for f in recurrence_flags(rows)], dtype=torch.int32, device=device),
            torch.tensor([f + [0] * (width - len(f)) for f in fold_rows], dtype=torch.int32, device=device),
        )


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
    tree: TreeRows | None = None  # the rows' tree structure and the folds' log rows; None: chains
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
        parents: list[list[int] | None] | None = None,
        fold_rows: list[list[int] | None] | None = None,
        log_rows: int = 0,
    ) -> SeqLayout:
        """A layout from host values; device tensors are made on `device`. `parents` (a sequence's row parents,
        None for a chain) and `fold_rows` (the log rows its fold replays, None for 0..fold-1) give the pass a
        `tree` when some sequence has either; `log_rows` is then the width of its fold table."""
        fold = list(fold) if fold else [0] * len(query_lens)
        speculative = [bool(s) for s in speculative] if speculative else [False] * len(query_lens)
        tables = block_tables or [[0]] * len(query_lens)
        width = max(len(t) for t in tables)
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)

        def int32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        tree = None
        if any(p is not None for p in parents or []) or any(f is not None for f in fold_rows or []):
            tree = TreeRows.build(
                [chain_parents(n) if p is None else p for n, p in zip(query_lens, parents or [None] * len(fold))],
                [list(range(n)) if f is None else f for n, f in zip(fold, fold_rows or [None] * len(fold))],
                log_rows,
                device,
            )
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
            tree,
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
