"""Runner: turns a schedule into a `ForwardBatch`, runs the model once (eagerly or as a CUDA graph
replay), returns logits of the rows that need them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaspec.engine.cuda_graphs import CudaGraphRunner
from deltaspec.engine.scheduler import Scheduled
from deltaspec.model.decoder import ModelCaches
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.hybrid import HybridModel
from deltaspec.ops.layout import SeqLayout


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
    logged: set[int]  # schedule positions without drafts that still ran as verify rows (their row is logged)
    greedy: list[int] | None  # argmax of every row (indexed like `hidden`), when the pass computed it on device


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
    layout = SeqLayout.build([item.num_rows for item in schedule],
                             [item.seq.num_computed + item.num_rows for item in schedule],
                             [item.seq.state_slot for item in schedule], device,
                             fold=[item.seq.pending_fold for item in schedule],
                             speculative=[bool(item.seq.draft) for item in schedule], block_tables=tables)

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(tensor(token_ids), tensor(positions), tensor(slot_mapping), layout)


class Runner:
    """Runs passes eagerly, or through `graphs` (CUDA graphs) when the pass fits one of its buckets."""

    def __init__(self, model: HybridModel, caches: ModelCaches, block_size: int, device: torch.device,
                 graphs: CudaGraphRunner | None = None):
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.device = device
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, schedule: list[Scheduled]) -> StepOutput:
        key = self.graphs.bucket_for(schedule) if self.graphs is not None else None
        if key is not None:
            replay = self.graphs.run(schedule, key)
            logged = {i for i, item in enumerate(schedule) if not item.seq.draft} if key[1] > 1 else set()
            return self._outputs(schedule, replay.hidden, replay.row_starts, lambda rows: replay.logits[rows],
                                 logged, replay.greedy)
        batch = build_batch(schedule, self.block_size, self.device)
        hidden = self.model(batch, self.caches)  # [T, hidden]
        return self._outputs(schedule, hidden, batch.layout.row_starts, lambda rows: self.model.compute_logits(
            hidden[rows]), set(), None)

    def _outputs(self, schedule: list[Scheduled], hidden: torch.Tensor, starts: list[int], logits_of,
                 logged: set[int], greedy: list[int] | None) -> StepOutput:
        verify_logits = {i: logits_of(slice(starts[i], starts[i] + item.num_rows))
                         for i, item in enumerate(schedule) if item.seq.draft}
        sample_index = [i for i, item in enumerate(schedule) if item.completes_prompt and not item.seq.draft]
        prompt_logits = {}
        for i, item in enumerate(schedule):
            seq = item.seq
            if seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids):
                prompt_rows = min(item.num_rows, len(seq.prompt_ids) - seq.num_computed)
                prompt_logits[i] = logits_of(slice(starts[i], starts[i] + prompt_rows))
        rows = [starts[i] + schedule[i].num_rows - 1 for i in sample_index]
        sample_logits = logits_of(rows) if rows else hidden.new_zeros(0)
        return StepOutput(sample_logits, sample_index, prompt_logits, verify_logits, hidden, starts, logged, greedy)
