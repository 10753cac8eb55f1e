"""The batched sampler: penalties, the filtered sampling distribution, and the per-request draw.

Everything works on a [B, V] batch with per-row `SamplingParams`, on whatever device the logits are
on, without Python loops over the vocabulary. `processed_probs` is public because speculative
rejection sampling needs the same distribution for both the target and the draft model.
Semantics follow vLLM: penalties as in `apply_penalties` of vLLM, greedy below `GREEDY_EPS`, and
each request draws from its own `torch.Generator`, so a seed gives the same tokens in any batch.
"""

from __future__ import annotations

import secrets

import torch

from deltaspec.sample.params import SamplingParams


def _check_batch(batch: int, **per_row: list) -> None:
    for name, values in per_row.items():
        if len(values) != batch:
            raise ValueError(f"{name} has {len(values)} entries for a batch of {batch} rows.")


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, or with a fresh random 63-bit number if None."""
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


def _penalise(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    params: list[SamplingParams],
) -> torch.Tensor:
    """Repetition, frequency and presence penalties for rows that use some; [R, V] -> [R, V]."""
    rows, vocab = logits.shape
    device = logits.device
    dtype = _work_dtype(logits)
    x = logits.to(dtype)  # [R, V]

    out_rows = [j for j, ids in enumerate(output_ids) for _ in ids]
    out_tokens = [t for ids in output_ids for t in ids]
    counts = torch.zeros(rows, vocab, dtype=dtype, device=device)  # [R, V]
    if out_tokens:
        counts.index_put_(
            (
                torch.tensor(out_rows, dtype=torch.long, device=device),
                torch.tensor(out_tokens, dtype=torch.long, device=device),
            ),
            torch.ones(len(out_tokens), dtype=dtype, device=device),
            accumulate=True,
        )
    in_output = counts > 0  # [R, V]

    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        # Prompt tokens only matter to rows with a repetition penalty.
        prompt_rows = [j for j, ids in enumerate(prompt_ids) if repetition[j] != 1.0 for _ in ids]
        prompt_tokens = [t for j, ids in enumerate(prompt_ids) if repetition[j] != 1.0 for t in ids]
        seen = in_output.clone()  # [R, V]
        if prompt_tokens:
            seen[
                torch.tensor(prompt_rows, dtype=torch.long, device=device),
                torch.tensor(prompt_tokens, dtype=torch.long, device=device),
            ] = True
        penalty = torch.tensor(repetition, dtype=dtype, device=device)[:, None]  # [R, 1]
        factor = torch.where(seen, penalty, 1.0)  # [R, V]
        x = torch.where(x > 0, x / factor, x * factor)

    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)
    x = x - frequency[:, None] * counts - presence[:, None] * in_output  # [R, V]
    return x.to(logits.dtype)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    params: list[SamplingParams],
    eos_ids: list[frozenset[int]],
) -> torch.Tensor:
    """Logits [B, V] with vLLM's penalties and the min_tokens mask applied; the input is untouched.

    Repetition penalty: tokens seen in the prompt or the output are divided by it when their logit
    is > 0 and multiplied by it otherwise. Frequency penalty: minus penalty * count in the output.
    Presence penalty: minus penalty when the token occurs in the output. While a row has fewer than
    `min_tokens` output tokens, its `eos_ids[i]` and `stop_token_ids` are set to -inf.
    Rows with neutral penalties are left alone; when no row needs anything the input is returned.
    """
    batch, vocab = logits.shape
    _check_batch(batch, prompt_ids=prompt_ids, output_ids=output_ids, params=params, eos_ids=eos_ids)
    penalised = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_ids[i]) < p.min_tokens:
            banned = sorted(t for t in eos_ids[i].union(p.stop_token_ids) if t < vocab)
            mask_rows.extend([i] * len(banned))
            mask_tokens.extend(banned)
    if not penalised and not mask_tokens:
        return logits

    out = logits.clone()  # [B, V]
    if penalised:
        index = torch.tensor(penalised, dtype=torch.long, device=logits.device)  # [R]
        out[index] = _penalise(
            out[index],
            [prompt_ids[i] for i in penalised],
            [output_ids[i] for i in penalised],
            [params[i] for i in penalised],
        )
    if mask_tokens:
        out[
            torch.tensor(mask_rows, dtype=torch.long, device=logits.device),
            torch.tensor(mask_tokens, dtype=torch.long, device=logits.device),
        ] = float("-inf")
    return out


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf what top-k then top-p drop; x [B, V] -> [B, V]. top_k 0 and top_p 1 are off."""
    _, vocab = x.shape
    device = x.device
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [B, V], ties: lower id first
    positions = torch.arange(vocab, device=device)  # [V]
    k = torch.tensor([vocab if k == 0 else k for k in top_k], device=device)  # [B]
    sorted_x = sorted_x.masked_fill(positions >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_x, dim=-1)  # [B, V]
        before = probs.cumsum(dim=-1) - probs  # [B, V], mass of the better tokens
        mass = torch.tensor([float("inf") if p >= 1.0 else p for p in top_p], dtype=x.dtype, device=device)  # [B]
        # Keep a token while the mass before it is short of top_p: the smallest set reaching top_p.
        drop = before >= mass[:, None]  # [B, V]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: probs [B, V], rows summing to 1.

    Non-greedy rows: logits / temperature, then top-k, then top-p (the smallest set of most likely
    tokens whose probability reaches top_p, at least one), then min-p (drop tokens below
    min_p * the largest probability), renormalised. Greedy rows: one-hot at the argmax (first index
    on ties). float32, or float64 for float64 logits.
    """
    batch, _ = logits.shape
    _check_batch(batch, params=params)
    device = logits.device
    x = logits.to(_work_dtype(logits))  # [B, V]
    greedy = [p.greedy for p in params]
    temperature = torch.tensor(
        [1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=x.dtype, device=device
    )  # [B]
    x = x / temperature[:, None]
    top_k = [0 if g else p.top_k for g, p in zip(greedy, params)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        x = _top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)  # [B, V]
    min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    if any(m > 0.0 for m in min_p):
        floor = torch.tensor(min_p, dtype=x.dtype, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        is_greedy = torch.tensor(greedy, device=device)[:, None]  # [B, 1]
        probs = torch.where(is_greedy, one_hot, probs)
    return probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row: tokens [B] long.

    Greedy rows take the argmax (first index on ties) and use no randomness. Other rows draw from
    `processed_probs` with the exponential race (argmax of probs / Exp(1) noise, exactly a draw from
    probs), the noise coming from that row's generator, or torch's default one where it is None.
    """
    batch, vocab = logits.shape
    _check_batch(batch, params=params, generators=generators)
    argmax = logits.argmax(dim=-1)  # [B]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return argmax
    probs = processed_probs(logits, params)  # [B, V]
    noise = torch.ones_like(probs)  # [B, V]
    shared = [i for i in sampled_rows if generators[i] is None]
    if shared:
        noise[torch.tensor(shared, device=logits.device)] = torch.empty(
            len(shared), vocab, dtype=probs.dtype, device=logits.device
        ).exponential_()
    for i in sampled_rows:
        if generators[i] is not None:
            noise[i].exponential_(generator=generators[i])
    # A zero draw would turn 0 / 0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    drawn = (probs / noise).argmax(dim=-1)  # [B]
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)  # [B]
    return torch.where(is_greedy, argmax, drawn)
