"""One pass's schedule entry (`Scheduled`: a sequence and its rows), the flat `ForwardBatch` built from a
schedule for an eager pass, and the device index tensors a pass gathers its rows with."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deltaspec.execution.sequence import Sequence
from deltaspec.model.forward_batch import ForwardBatch, ImageRows
from deltaspec.ops.layout import SeqLayout


@dataclass
class Scheduled:
    seq: Sequence
    num_rows: int

    @property
    def completes_prompt(self) -> bool:
        """After this pass the sequence has computed all of its tokens and samples a new one."""
        return self.seq.cache.num_computed + self.num_rows >= self.seq.num_tokens


@functools.lru_cache(maxsize=512)
def device_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(rows)] long on `device`, kept for the next pass with the same rows (a decode step's are the same
    every step), so a graph replay's gathers need no host-to-device copy. Read-only."""
    return torch.tensor(rows, dtype=torch.long, device=device)


def build_batch(schedule: list[Scheduled], block_size: int, device: torch.device) -> ForwardBatch:
    """The pass's rows back to back: each sequence's next `num_rows` tokens (drafts included) at its positions,
    their KV slots, and the layout (state slots, replay-log folds, verify rows, block tables, and the rows' tree
    when a sequence verifies a tree of drafts or folds the path of one)."""
    token_ids, positions, slot_mapping, tables = [], [], [], []
    for item in schedule:
        seq, start = item.seq, item.seq.cache.num_computed
        span = range(start, start + item.num_rows)
        ids = seq.row_ids
        token_ids.extend(ids[p] for p in span)
        positions.extend(seq.rope_positions(item.num_rows))
        slot_mapping.extend(seq.cache.kv_slots(span, block_size))
        tables.append(seq.cache.blocks)
    layout = SeqLayout.build(
        [item.num_rows for item in schedule],
        [item.seq.cache.num_computed + item.num_rows for item in schedule],
        [item.seq.cache.state_slot for item in schedule],
        device,
        fold=[item.seq.cache.replay.pending_fold for item in schedule],
        speculative=[bool(item.seq.proposal.tokens) for item in schedule],
        block_tables=tables,
        parents=[item.seq.proposal.row_parents(item.num_rows) for item in schedule],
        fold_rows=[item.seq.cache.replay.fold_rows for item in schedule],
    )

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        tensor(token_ids), tensor(positions), tensor(slot_mapping), layout, image_rows(schedule, positions, device)
    )


def image_rows(schedule: list[Scheduled], positions: list[int], device: torch.device) -> ImageRows | None:
    """The pass's image rows (`ImageRows`) when some of its rows are image tokens of a prompt, else None: the
    three position streams of every row (a text row's are its `positions` entry thrice) and the embeddings of the
    image-token rows."""
    if all(item.seq.request.images is None for item in schedule):
        return None
    streams = torch.tensor(positions, dtype=torch.long).expand(3, -1).clone()
    rows, embeds, first, sections = [], [], 0, None
    for item in schedule:
        seq, start = item.seq, item.seq.cache.num_computed
        images, prompt_rows = seq.request.images, range(start, min(start + item.num_rows, len(seq.request.prompt_ids)))
        if images is not None and any(images.embed_rows[p] >= 0 for p in prompt_rows):
            streams[:, first : first + len(prompt_rows)] = images.positions[:, prompt_rows.start : prompt_rows.stop]
            taken = [p for p in prompt_rows if images.embed_rows[p] >= 0]
            rows.extend(first + p - start for p in taken)
            embeds.append(images.embeds[[images.embed_rows[p] for p in taken]])
            sections = images.sections
        first += item.num_rows
    if not rows:
        return None
    return ImageRows(
        streams.to(device), sections, torch.tensor(rows, dtype=torch.long, device=device), torch.cat(embeds)
    )
