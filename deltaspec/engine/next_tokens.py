"""The next token of every sequence that samples one this pass without verifying drafts: the pass's argmax
for plain greedy sequences, else penalties, the structured-output mask, sampling with the sequence's generator,
and logprobs (of the raw logits)."""

from __future__ import annotations

import torch

from deltaspec.execution.runner import SeqOutput
from deltaspec.sample.logprobs import gather_logprobs
from deltaspec.sample.sampler import apply_penalties, sample
from deltaspec.sample.structured import mask_next


def next_tokens(outputs: list[SeqOutput]) -> list[tuple[int, object]]:
    """(token, its logprobs or None) for each of `outputs`, in order."""
    picked: dict[int, tuple[int, object]] = {id(out): (out.argmax[-1], None) for out in outputs if out.logits is None}
    sampling = [out for out in outputs if out.logits is not None]
    if sampling:
        seqs = [out.seq for out in sampling]
        params = [seq.request.params for seq in seqs]
        raw = torch.cat([out.logits for out in sampling])  # [len(sampling), vocab]
        logits = apply_penalties(
            raw,
            [s.request.prompt_ids for s in seqs],
            [s.output_ids for s in seqs],
            params,
            [s.request.eos_ids for s in seqs],
        )
        logits = mask_next(logits, [s.request.grammar for s in seqs])
        tokens = sample(logits, params, [s.request.generator for s in seqs])
        wanted = [p.logprobs for p in params]
        logprobs = gather_logprobs(raw, tokens, wanted) if any(w is not None for w in wanted) else [None] * len(seqs)
        picked.update({id(out): (token, lp) for out, token, lp in zip(sampling, tokens.tolist(), logprobs)})
    return [picked[id(out)] for out in outputs]
