"""llama-perplexity's next-token records (test helper): `--kl-divergence-base` files as read by
tools/make_llama_logits.py (tokens, and per scored position a float32 scale and minimum log-probability and one
uint16 per vocabulary entry over the top 16 nats), turned into log-probabilities and compared with deltaspec's."""

from __future__ import annotations

import numpy as np
import torch

from deltaspec.evaluate_kl import window_logits


def log_probs_of(record) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's recorded log-softmax [windows, rows, vocab] (float64) and the mask of the entries it kept
    (within 16 nats of the row's top; the rest were clamped to the row's minimum). `record` maps "tokens",
    "quants", "scale" and "min_log_prob" to arrays."""
    quants = torch.from_numpy(np.asarray(record["quants"]).astype(np.float64))
    scale = torch.from_numpy(np.asarray(record["scale"]).astype(np.float64))[..., None]
    low = torch.from_numpy(np.asarray(record["min_log_prob"]).astype(np.float64))[..., None]
    return low + scale * quants, quants > 0


def kl_over_kept(theirs: torch.Tensor, ours: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """KL(llama.cpp || deltaspec) per position [N] over the entries llama.cpp's record kept, both distributions
    renormalised on them (the clamped tail holds under e**-16 of a row's top each)."""
    theirs = torch.log_softmax(theirs.masked_fill(~kept, -torch.inf), dim=-1)
    ours = torch.log_softmax(ours.masked_fill(~kept, -torch.inf), dim=-1)
    return (theirs.exp() * (theirs - ours)).masked_fill(~kept, 0.0).sum(-1).flatten()


def scored_log_probs(engine, tokens: np.ndarray) -> torch.Tensor:
    """deltaspec's float64 log-softmax [windows, rows, vocab] at the positions llama-perplexity scored: c/2 .. c-2
    of each window of `tokens` [windows, c]."""
    context = tokens.shape[1]
    rows = [window_logits(engine, window)[context // 2 : context - 1].double() for window in tokens.tolist()]
    return torch.log_softmax(torch.stack(rows), dim=-1)
