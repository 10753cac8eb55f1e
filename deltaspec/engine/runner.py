"""Runner: turns a schedule into a `ForwardBatch`, runs the model once, returns logits of the rows
that need them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaspec.engine.scheduler import Scheduled
from deltaspec.model.decoder import ModelCaches
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.hybrid import HybridModel


@dataclass
class StepOutput:
    """Logits of the rows the engine asked for: each sampling sequence's last row, every row of
    sequences verifying drafts, and every prompt row of sequences that asked for prompt logprobs."""

    sample_logits: torch.Tensor  # [num sampling sequences, vocab]
    sample_index: list[int]  # position in the schedule of each sampling sequence (no drafts)
    prompt_logits: dict[int, torch.Tensor]  # schedule position -> [rows, vocab]
    verify_logits: dict[int, torch.Tensor]  # schedule position -> [1 + k, vocab] of sequences verifying k drafts
    hidden: torch.Tensor  # [T, hidden] final hidden state of every row (the MTP drafter reads committed ones)
    row_starts: list[int]  # first row of each scheduled sequence


def build_batch(schedule: list[Scheduled], block_size: int, device: torch.device) -> ForwardBatch:
    token_ids, positions, slot_mapping, tables = [], [], [], []
    for item in schedule:
        seq, start = item.seq, item.seq.num_computed
        span = range(start, start + item.num_rows)
        ids = seq.row_ids
        token_ids.extend(ids[p] for p in span)
        positions.extend(span)
        slot_mapping.extend(seq.blocks[p // block_size] * block_size + p % block_size for p in span)
        tables.append(seq.blocks)
    width = max(len(t) for t in tables)
    block_tables = [t + [0] * (width - len(t)) for t in tables]
    slots = [item.seq.state_slot for item in schedule]

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        token_ids=tensor(token_ids), positions=tensor(positions), slot_mapping=tensor(slot_mapping),
        block_tables=tensor(block_tables), state_slots=tensor(slots),
        query_lens=[item.num_rows for item in schedule],
        context_lens=[item.seq.num_computed + item.num_rows for item in schedule],
        state_slot_list=slots,
        fold=[item.seq.pending_fold for item in schedule],
        speculative=[bool(item.seq.draft) for item in schedule],
    )


class Runner:
    def __init__(self, model: HybridModel, caches: ModelCaches, block_size: int, device: torch.device):
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, schedule: list[Scheduled]) -> StepOutput:
        batch = build_batch(schedule, self.block_size, self.device)
        hidden = self.model(batch, self.caches)  # [T, hidden]
        ends = batch.last_row_indices
        verify_logits = {i: self.model.compute_logits(hidden[ends[i] - item.num_rows + 1:ends[i] + 1])
                         for i, item in enumerate(schedule) if item.seq.draft}
        sample_index = [i for i, item in enumerate(schedule) if item.completes_prompt and not item.seq.draft]
        rows = [ends[i] for i in sample_index]
        prompt_logits = {}
        for i, item in enumerate(schedule):
            seq = item.seq
            if seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids):
                first = ends[i] - item.num_rows + 1
                prompt_rows = min(item.num_rows, len(seq.prompt_ids) - seq.num_computed)
                prompt_logits[i] = self.model.compute_logits(hidden[first:first + prompt_rows])
        sample_logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_zeros(0)
        return StepOutput(sample_logits, sample_index, prompt_logits, verify_logits, hidden,
                          [end - item.num_rows + 1 for end, item in zip(ends, schedule)])
