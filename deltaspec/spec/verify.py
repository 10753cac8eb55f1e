"""Verification of draft tokens against the target model: greedy and lossless rejection sampling.

Layout. Sequence b proposes `k_b >= 0` draft tokens `drafts[b]`; the target ran 1 + k_b rows for it,
so `target_logits[b]` is [1 + k_b, V]: row i is the target's prediction for the token after the
first i drafts (row 0 predicts the first draft, row k_b the bonus token after all of them).

API. Both functions return a `VerifyResult`:

- `tokens[b]`: the tokens to append, the accepted drafts followed by exactly one target token (the
  correction at the first rejection, or the bonus token when every draft was accepted), so
  1 <= len(tokens[b]) <= k_b + 1.
- `accepted[b]`: how many drafts were accepted (always len(tokens[b]) - 1), the acceptance counter
  for metrics and adaptive draft lengths.

`verify_greedy(target_logits, drafts)`: accept while the target's argmax (first index on ties, as
`torch.argmax`) equals the draft, then append the target's argmax. Equals plain greedy decoding
token for token.

`verify_greedy_tokens(target_argmax, drafts)`: the same from the target's argmax of each row (host ints),
when the pass computed them on device.

`verify_sampling(target_logits, drafts, draft_probs, params, generators)`: lossless speculative
sampling (Leviathan et al. 2023, Chen et al. 2023). With p_i = `processed_probs(target row i)` and
q_i the drafter's distribution for draft i (`draft_probs[b]` [k_b, V], processed with the same
sampling parameters by the caller; None means a deterministic drafter such as n-gram, q one-hot at
the draft token): draft d_i is accepted when u_i * q_i[d_i] < p_i[d_i] with u_i ~ U[0, 1), i.e. with
probability min(1, p_i[d_i] / q_i[d_i]); at the first rejection the replacement is drawn from
norm(max(0, p_i - q_i)) (from p_i if that is all zero) and the row stops; when all drafts are
accepted the bonus token is drawn from p_{k_b}. The emitted tokens are then distributed exactly as
if sampled one by one from the target. Greedy rows (`params[b].greedy`) give exactly
`verify_greedy`'s result and use no randomness.

Randomness (fixed consumption order, so a seed gives the same tokens in any batch and any batch
order). Each non-greedy sequence with a generator draws, from its own generator and always in this
order: `torch.rand(k_b)` (the u_i for all k_b drafts, drawn even when an early draft is rejected),
then one `[V]` Exp(1) vector for the final token (the exponential race: argmax of dist / noise is a
draw from dist, as in `deltaspec.sample.sampler.sample`). Both are drawn in the dtype of the
processed probabilities (float32, float64 for float64 logits) on the logits' device. Non-greedy
sequences whose generator is None share torch's default generator: one `rand` for all their drafts
(concatenated in batch order), then one `[n, V]` Exp(1) draw (rows in batch order).
Greedy sequences draw nothing.

Everything is batched over the concatenated rows (no Python loops over the vocabulary; the only
per-sequence loops build index lists and draw from per-sequence generators) and needs a single
device-to-host transfer at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import processed_probs


@dataclass
class VerifyResult:
    """Per sequence: the tokens to append (accepted drafts + one target token) and the accepted
    draft count (len(tokens[b]) - 1)."""

    tokens: list[list[int]]
    accepted: list[int]


@dataclass
class _Layout:
    """Where each sequence's rows lie in the concatenated [R, V] batch."""

    offsets: torch.Tensor  # [B] long, first row of each sequence
    segment: torch.Tensor  # [R] long, the sequence of each row
    position: torch.Tensor  # [R] long, the row's index inside its sequence
    draft_ids: torch.Tensor  # [R] long, the draft the row judges (0 on bonus rows)
    is_draft: torch.Tensor  # [R] bool, False on each sequence's last (bonus) row
    starts: list[int]  # offsets as Python ints


def _layout(target_logits: list[torch.Tensor], drafts: list[list[int]], device: torch.device) -> _Layout:
    if len(drafts) != len(target_logits):
        raise ValueError(f"drafts has {len(drafts)} entries for {len(target_logits)} sequences of logits.")
    vocab = target_logits[0].shape[-1]
    starts: list[int] = []
    segment: list[int] = []
    position: list[int] = []
    draft_ids: list[int] = []
    is_draft: list[bool] = []
    total = 0
    for b, (logits, draft) in enumerate(zip(target_logits, drafts)):
        k = len(draft)
        if logits.dim() != 2 or logits.shape[0] != k + 1 or logits.shape[1] != vocab:
            raise ValueError(
                f"target_logits[{b}] has shape {tuple(logits.shape)}, expected ({k + 1}, {vocab}) for {k} drafts."
            )
        if any(not 0 <= t < vocab for t in draft):
            raise ValueError(f"drafts[{b}] has a token outside [0, {vocab}): {draft}.")
        starts.append(total)
        segment.extend([b] * (k + 1))
        position.extend(range(k + 1))
        draft_ids.extend(draft)
        draft_ids.append(0)
        is_draft.extend([True] * k)
        is_draft.append(False)
        total += k + 1

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return _Layout(
        offsets=as_tensor(starts, torch.long),
        segment=as_tensor(segment, torch.long),
        position=as_tensor(position, torch.long),
        draft_ids=as_tensor(draft_ids, torch.long),
        is_draft=as_tensor(is_draft, torch.bool),
        starts=starts,
    )


def _leading_accepted(accept: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Per sequence, how many of its first rows are accepted before the first that is not: [B].

    Bonus rows are never accepted, so the answer for sequence b is at most k_b.
    """
    rows = accept.shape[0]
    batch = layout.offsets.shape[0]
    stop_at = torch.where(accept, rows, layout.position)  # [R]
    first = torch.full((batch,), rows, dtype=torch.long, device=accept.device)  # [B]
    return first.scatter_reduce(0, layout.segment, stop_at, reduce="amin")


def _result(drafts: list[list[int]], accepted: torch.Tensor, final: torch.Tensor) -> VerifyResult:
    counts, finals = torch.stack([accepted, final]).tolist()  # the one device-to-host transfer
    tokens = [list(d[:n]) + [t] for d, n, t in zip(drafts, counts, finals)]
    return VerifyResult(tokens=tokens, accepted=counts)


def verify_greedy_tokens(target_argmax: list[list[int]], drafts: list[list[int]]) -> VerifyResult:
    """Greedy verification from each row's argmax (`target_argmax[b]` has 1 + k_b entries)."""
    tokens, accepted = [], []
    for argmax, draft in zip(target_argmax, drafts):
        n = next((i for i, (t, d) in enumerate(zip(argmax, draft)) if t != d), len(draft))
        tokens.append(list(argmax[: n + 1]))
        accepted.append(n)
    return VerifyResult(tokens, accepted)


def verify_greedy(target_logits: list[torch.Tensor], drafts: list[list[int]]) -> VerifyResult:
    """Greedy verification: accept drafts while they equal the target's argmax, then append the
    target's argmax at the first mismatch (or the bonus row's argmax when all were accepted)."""
    if not target_logits:
        return VerifyResult(tokens=[], accepted=[])
    logits = torch.cat(list(target_logits))  # [R, V]
    layout = _layout(target_logits, drafts, logits.device)
    argmax = logits.argmax(dim=-1)  # [R], first index on ties
    match = layout.is_draft & (argmax == layout.draft_ids)  # [R]
    accepted = _leading_accepted(match, layout)  # [B]
    final = argmax[layout.offsets + accepted]  # [B]
    return _result(drafts, accepted, final)


def verify_sampling(
    target_logits: list[torch.Tensor],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> VerifyResult:
    """Lossless speculative sampling (see the module docstring for the rule and the order in which
    randomness is drawn). Greedy rows give exactly `verify_greedy`'s tokens and draw nothing."""
    batch = len(target_logits)
    for name, values in (
        ("drafts", drafts),
        ("draft_probs", draft_probs),
        ("params", params),
        ("generators", generators),
    ):
        if len(values) != batch:
            raise ValueError(f"{name} has {len(values)} entries for {batch} sequences.")
    if batch == 0:
        return VerifyResult(tokens=[], accepted=[])
    greedy = [p.greedy for p in params]
    if all(greedy):
        return verify_greedy(target_logits, drafts)

    logits = torch.cat(list(target_logits))  # [R, V]
    rows, vocab = logits.shape
    device = logits.device
    layout = _layout(target_logits, drafts, device)
    ks = [len(d) for d in drafts]
    row_params = [p for p, k in zip(params, ks) for _ in range(k + 1)]
    p = processed_probs(logits, row_params)  # [R, V]
    dtype = p.dtype

    # q: the drafter's distribution on draft rows, zero on bonus rows (so the residual there is p).
    q = torch.zeros_like(p)  # [R, V]
    one_hot_rows: list[int] = []
    for b, (probs, k, start) in enumerate(zip(draft_probs, ks, layout.starts)):
        if greedy[b] or k == 0:
            continue
        if probs is None:
            one_hot_rows.extend(range(start, start + k))
            continue
        if tuple(probs.shape) != (k, vocab):
            raise ValueError(f"draft_probs[{b}] has shape {tuple(probs.shape)}, expected ({k}, {vocab}).")
        q[start : start + k] = probs.to(device=device, dtype=dtype)
    if one_hot_rows:
        index = torch.tensor(one_hot_rows, dtype=torch.long, device=device)
        q[index, layout.draft_ids[index]] = 1.0

    # Randomness, in the documented order: per generator, k uniforms then one [V] Exp(1) vector.
    uniform = torch.zeros(rows, dtype=dtype, device=device)  # [R]; 0 on greedy rows
    noise = torch.ones(batch, vocab, dtype=dtype, device=device)  # [B, V]
    shared_rows: list[int] = []
    shared_seqs: list[int] = []
    for b, (generator, k, start) in enumerate(zip(generators, ks, layout.starts)):
        if greedy[b]:
            continue
        if generator is None:
            shared_rows.extend(range(start, start + k))
            shared_seqs.append(b)
            continue
        if k:
            uniform[start : start + k] = torch.rand(k, generator=generator, dtype=dtype, device=device)
        noise[b].exponential_(generator=generator)
    if shared_seqs:
        if shared_rows:
            uniform[torch.tensor(shared_rows, dtype=torch.long, device=device)] = torch.rand(
                len(shared_rows), dtype=dtype, device=device
            )
        noise[torch.tensor(shared_seqs, dtype=torch.long, device=device)] = torch.empty(
            len(shared_seqs), vocab, dtype=dtype, device=device
        ).exponential_()
    # A zero draw would turn 0 / 0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(dtype).tiny)

    # Accept d with probability min(1, p[d] / q[d]): u * q[d] < p[d] for u ~ U[0, 1). On greedy
    # rows u = 0 and p is one-hot at the argmax, so this is exactly "d == argmax".
    ids = layout.draft_ids[:, None]  # [R, 1]
    p_draft = p.gather(1, ids).squeeze(1)  # [R]
    q_draft = q.gather(1, ids).squeeze(1)  # [R]
    accept = layout.is_draft & (uniform * q_draft < p_draft)  # [R]
    accepted = _leading_accepted(accept, layout)  # [B]

    # The final token: from norm(max(0, p - q)) at the rejected row, p where that is all zero;
    # on the bonus row q = 0, so this is p itself.
    final_rows = layout.offsets + accepted  # [B]
    p_final = p[final_rows]  # [B, V]
    residual = (p_final - q[final_rows]).clamp_min_(0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(dtype).tiny), p_final)
    drawn = (dist / noise).argmax(dim=-1)  # [B]
    target_argmax = logits[final_rows].argmax(dim=-1)  # [B]
    is_greedy = torch.tensor(greedy, dtype=torch.bool, device=device)  # [B]
    final = torch.where(is_greedy, target_argmax, drawn)
    return _result(drafts, accepted, final)
