"""Drive an engine's model directly: prefill given chunks and collect the logits of every row."""

from __future__ import annotations

import torch

from deltaspec.execution.batch import Scheduled, build_batch
from deltaspec.execution.request import Request
from deltaspec.execution.sequence import Sequence
from deltaspec.sample.params import SamplingParams


def new_sequence(engine, token_ids: list[int]) -> Sequence:
    seq = Sequence(Request("test", None, list(token_ids), SamplingParams(max_tokens=1), frozenset()))
    engine.cache.admit(seq.cache, seq.all_ids, resume=seq.request.params.prompt_logprobs is None)
    return seq


@torch.inference_mode()
def run_rows(engine, items: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
    """One forward over `(sequence, rows)` items; returns each item's logits [rows, vocab]."""
    schedule = [Scheduled(seq, rows) for seq, rows in items]
    for seq, rows in items:
        assert engine.cache.reserve(seq.cache, seq.cache.num_computed + rows)
    batch = build_batch(schedule, engine.cache.block_size, engine.device)
    logits = engine.model.compute_logits(engine.model(batch, engine.cache.caches))
    out, start = [], 0
    for seq, rows in items:
        out.append(logits[start : start + rows])
        seq.cache.num_computed += rows
        start += rows
    return out


def forward_in_chunks(engine, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Prefill `token_ids` in chunks of the given sizes; logits of every position [L, vocab]."""
    assert sum(chunks) == len(token_ids)
    seq = new_sequence(engine, token_ids)
    try:
        return torch.cat([run_rows(engine, [(seq, rows)])[0] for rows in chunks])
    finally:
        engine.cache.release(seq.cache)
