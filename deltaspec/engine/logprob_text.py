"""Logprobs as users see them: each entry with its token's text, and prompt logprobs recorded chunk by chunk."""

from __future__ import annotations

import torch

from deltaspec.execution.sequence import Sequence
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.logprobs import gather_logprobs


class LogprobText:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def __call__(self, logprobs: dict) -> dict:
        """`logprobs` (token -> Logprob) with each token's decoded text."""
        if self.tokenizer is None:
            return logprobs
        return {t: type(lp)(lp.logprob, lp.rank, self.tokenizer.decode_token(t)) for t, lp in logprobs.items()}

    def record_prompt(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Logprob of each next prompt token given its prefix (the first prompt token gets None), from the logits
        of prompt rows from position `start`. A sequence recomputed after preemption does not record them twice."""
        if start == 0 and not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        if len(seq.prompt_logprobs) != start + 1:
            return
        targets = seq.request.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
        if not targets:
            return
        rows = logits[: len(targets)]
        got = gather_logprobs(
            rows, torch.tensor(targets, device=rows.device), [seq.request.params.prompt_logprobs] * len(targets)
        )
        seq.prompt_logprobs.extend(self(lp) for lp in got)
