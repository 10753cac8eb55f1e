"""Log-probabilities returned with tokens: vLLM's `Logprob` record and the batched gather for it.

Logprobs come from the raw logits (before penalties, temperature and top-k/top-p/min-p), which is
vLLM v1's default. Ranks are 1-based positions in the order "higher logprob first, then lower token
id first", so every token of a row has a distinct rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability, its 1-based rank in its row, its text once decoded."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def _top_tokens(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best tokens, best first, ties to the lower id: (ids, logprobs), each [R, k]."""
    rows, vocab = logprobs.shape
    if k == 0:
        empty = torch.empty(rows, 0, device=logprobs.device)  # [R, 0]
        return empty.long(), empty.to(logprobs.dtype)
    vocab_ids = torch.arange(vocab, device=logprobs.device)  # [V]
    kth = logprobs.topk(k, dim=-1).values[:, -1:]  # [R, 1]
    above = logprobs > kth  # [R, V]
    tied = logprobs == kth  # [R, V]
    room = k - above.sum(dim=-1, keepdim=True)  # [R, 1]
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))  # [R, V], exactly k per row
    # Kept tokens get distinct positive keys, larger for lower ids; the k largest are the kept ids.
    key = torch.where(keep, vocab - vocab_ids, 0)  # [R, V]
    ids = vocab - key.topk(k, dim=-1).values  # [R, k], ascending token id
    values = logprobs.gather(1, ids)  # [R, k]
    order = values.argsort(dim=-1, descending=True, stable=True)  # [R, k]
    return ids.gather(1, order), values.gather(1, order)


def gather_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int | None]
) -> list[dict[int, Logprob] | None]:
    """Logprobs of each row's chosen token and of its `num_top[i]` most likely tokens.

    logits: [B, V] raw logits; chosen: [B] long token ids; num_top: per row, how many top tokens to
    return, or None when the row asked for no logprobs (its entry in the result is None).
    Each dict holds the chosen token first, then the top tokens in rank order (the chosen token
    appears once even when it is among them). Computed in float32, or float64 for float64 logits.
    """
    batch, vocab = logits.shape
    if chosen.shape != (batch,) or len(num_top) != batch:
        raise ValueError(
            f"gather_logprobs needs chosen [{batch}] and {batch} num_top entries, "
            f"got {tuple(chosen.shape)} and {len(num_top)}."
        )
    result: list[dict[int, Logprob] | None] = [None] * batch
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return result
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    row_index = torch.tensor(rows, device=logits.device)  # [R]
    logprobs = torch.log_softmax(logits[row_index].to(dtype), dim=-1)  # [R, V]
    chosen_ids = chosen[row_index].long()  # [R]
    chosen_lp = logprobs.gather(1, chosen_ids[:, None])  # [R, 1]
    vocab_ids = torch.arange(vocab, device=logits.device)  # [V]
    chosen_rank = (
        1
        + (logprobs > chosen_lp).sum(dim=-1)
        + ((logprobs == chosen_lp) & (vocab_ids < chosen_ids[:, None])).sum(dim=-1)
    )  # [R]
    k = min(max(num_top[i] for i in rows), vocab)
    top_ids, top_lp = _top_tokens(logprobs, k)  # [R, k], [R, k]

    chosen_ids_h = chosen_ids.tolist()
    chosen_lp_h = chosen_lp.squeeze(1).tolist()
    chosen_rank_h = chosen_rank.tolist()
    top_ids_h = top_ids.tolist()
    top_lp_h = top_lp.tolist()
    for j, row in enumerate(rows):
        entry = {chosen_ids_h[j]: Logprob(chosen_lp_h[j], chosen_rank_h[j])}
        for position in range(min(num_top[row], vocab)):
            entry.setdefault(top_ids_h[j][position], Logprob(top_lp_h[j][position], position + 1))
        result[row] = entry
    return result
