"""Runner: runs one pass over a schedule — eagerly, or as a CUDA-graph replay when the pass fits a captured
bucket — and returns one `SeqOutput` per scheduled sequence, the same structure on both paths.

A sequence's token rows are the rows whose next token the engine decides: every row when it verifies
drafts (row i predicts the token after i drafts), else its last row when the pass completes its prompt or
decodes; a prompt chunk that leaves part of the prompt has none. The pass returns the argmax of every
token row (one device-to-host copy per pass) and the logits of a sequence's token rows only when the
argmax is not enough for it (sampling, penalties, logprobs, unmet min_tokens). On a pipeline stage the layers run
micro-batch by micro-batch (`PipelinePass`), and every stage goes on from the last stage's hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaspec.cache.model_caches import ModelCaches
from deltaspec.execution.batch import Scheduled, build_batch, device_index
from deltaspec.execution.cuda_graphs import CudaGraphRunner
from deltaspec.execution.pipeline_pass import PipelinePass
from deltaspec.execution.sequence import Sequence
from deltaspec.model.hybrid import HybridModel


@dataclass
class SeqOutput:
    """What one pass computed for one scheduled sequence."""

    seq: Sequence
    first_position: int  # tokens the sequence had computed before the pass: its first row's position
    rows: int  # rows the pass ran for it
    verifying: bool  # it verified drafts: its rows are the last sampled token and the drafts
    logged: bool  # its rows went into the replay log (a verify pass) instead of advancing its state
    hidden: torch.Tensor  # [rows, hidden] final hidden state of each row
    features: torch.Tensor | None  # [rows, taps * hidden] the model's `feature_layers` outputs; None without them
    argmax: list[int]  # argmax of each token row
    logits: torch.Tensor | None  # [token rows, vocab], only when the argmax is not enough
    prompt_logits: torch.Tensor | None  # [prompt rows, vocab], when the sequence asked for prompt logprobs


def token_rows(item: Scheduled) -> range:
    """Rows (within the sequence's rows of the pass) whose next token the engine decides."""
    if item.seq.proposal.tokens:
        return range(item.num_rows)
    return range(item.num_rows - 1, item.num_rows) if item.completes_prompt else range(0)


class Runner:
    """Runs passes eagerly, or through `graphs` (CUDA graphs) when the pass fits one of its buckets, or as one
    pipeline stage (`staged`) of several."""

    def __init__(
        self,
        model: HybridModel,
        caches: ModelCaches,
        block_size: int,
        device: torch.device,
        graphs: CudaGraphRunner | None = None,
        staged: PipelinePass | None = None,
    ):
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.device = device
        self.graphs = graphs
        self.staged = staged

    @torch.inference_mode()
    def execute(self, schedule: list[Scheduled]) -> list[SeqOutput]:
        starts = [0]
        for item in schedule:
            starts.append(starts[-1] + item.num_rows)
        key = self.graphs.bucket_for(schedule) if self.graphs is not None else None
        if key is not None:
            replay = self.graphs.run(schedule, key)
            picks = self._token_rows_at([b * key[1] for b in range(len(schedule))], schedule)  # bucket rows
            return self._outputs(
                schedule,
                starts,
                replay.hidden,
                replay.features,
                replay.greedy.index_select(0, picks).tolist(),
                key[1] > 1,
                lambda lo, hi: replay.logits.index_select(0, picks[lo:hi]),
                lambda lo, hi: replay.logits.index_select(0, replay.rows[lo:hi]),
            )
        if self.staged is not None:
            hidden, features = self.staged.run(self.model, self.caches, schedule, self.block_size, self.device), None
        else:
            batch = build_batch(schedule, self.block_size, self.device)
            hidden, features = self.model.run(batch, self.caches)  # [T, hidden], [T, taps * hidden] or None
        logits = self.model.compute_logits(hidden[self._token_rows_at(starts, schedule)])  # [token rows, vocab]
        return self._outputs(
            schedule,
            starts,
            hidden,
            features,
            logits.argmax(-1).tolist(),
            None,
            lambda lo, hi: logits[lo:hi],
            lambda lo, hi: self.model.compute_logits(hidden[lo:hi]),
        )

    def _token_rows_at(self, firsts: list[int], schedule: list[Scheduled]) -> torch.Tensor:
        """[token rows of the pass] long: where each token row lies, sequence i's rows starting at `firsts[i]`."""
        return device_index(
            tuple(first + r for item, first in zip(schedule, firsts) for r in token_rows(item)), self.device
        )

    def _outputs(
        self,
        schedule: list[Scheduled],
        starts: list[int],
        hidden: torch.Tensor,
        features: torch.Tensor | None,
        argmax: list[int],
        all_logged: bool | None,
        token_logits: Callable[[int, int], torch.Tensor],
        row_logits: Callable[[int, int], torch.Tensor],
    ) -> list[SeqOutput]:
        """Split a pass's outputs by sequence. `hidden` (and `features`, when the model taps layers) holds the real
        rows back to back (sequence i from `starts[i]`); `argmax` and `token_logits(lo, hi)` cover the token rows in
        schedule order; `row_logits(lo, hi)` are the logits of rows lo..hi-1 of `hidden`. `all_logged` says whether a
        graph bucket logged every sequence (None: an eager pass, which logs exactly the verifying ones)."""
        outputs, taken = [], 0
        for item, start in zip(schedule, starts):
            seq, count = item.seq, len(token_rows(item))
            logits = token_logits(taken, taken + count) if count and not seq.plain_greedy else None
            prompt_logits = None
            if seq.request.params.prompt_logprobs is not None and seq.cache.num_computed < len(seq.request.prompt_ids):
                prompt_rows = min(item.num_rows, len(seq.request.prompt_ids) - seq.cache.num_computed)
                prompt_logits = row_logits(start, start + prompt_rows)
            logged = bool(seq.proposal.tokens) if all_logged is None else all_logged
            outputs.append(
                SeqOutput(
                    seq,
                    seq.cache.num_computed,
                    item.num_rows,
                    bool(seq.proposal.tokens),
                    logged,
                    hidden[start : start + item.num_rows],
                    None if features is None else features[start : start + item.num_rows],
                    argmax[taken : taken + count],
                    logits,
                    prompt_logits,
                )
            )
            taken += count
        return outputs
