"""The `Drafter` protocol: what every speculative drafter (ngram, mtp, draft, block) implements.

A drafter proposes draft tokens for a batch of sequences; the target model verifies them in one
forward; the Speculator (`deltaspec.spec.speculator`) then tells the drafter what was committed.
The contract, precisely:

`propose(requests) -> drafts`
    * One `DraftRequest` per sequence, distinct `seq_id`s within a call. `token_ids` is the
      sequence's whole context: prompt + generated tokens, ending with the last sampled token
      (which the target has not computed yet, so it is the first input of the verify pass).
      The list belongs to the caller: a drafter must neither mutate it nor keep a reference
      to it (copy what it needs).
    * Returns exactly one `Draft` per request, in request order. `len(draft.tokens) <=
      request.max_tokens`; an empty draft ("nothing worth proposing") is always allowed.
      `max_tokens == 0` is legal: the drafter proposes nothing but may still ingest the context
      (e.g. to keep its caches current).
    * `draft.tokens[i]` is the drafter's guess for the token at position
      `len(token_ids) + i`, i.e. the continuation of `token_ids + tokens[:i]`.
    * `draft.probs`: for drafters that sample, a `[len(tokens), V]` float tensor (V = the target's
      vocabulary size, on the target's device); row i is the draft distribution q(. | token_ids +
      tokens[:i]) from which `tokens[i]` was drawn, rows summing to 1. The verifier uses it for
      lossless rejection sampling (accept with min(1, p/q), resample from norm(max(0, p - q))).
      `None` means the drafter is deterministic (n-gram lookup, greedy drafting): the verifier
      treats q as one-hot on `tokens[i]`.
    * `draft.confidence`: optional per-token scores in [0, 1] (higher = more likely accepted),
      for the draft-length policy and for choosing between drafters; not calibrated
      probabilities unless a drafter documents so. `None` = no opinion.

    * `request.candidates` > 0 (the Speculator grows a tree of drafts, `deltaspec.spec.tree`): a drafter that has
      a distribution per position drafts its first choice there (the argmax, also for sampled requests) and
      reports in `draft.candidates[i]` its `candidates` most likely tokens at position i with their probabilities
      (most likely first; the distribution is the one `tokens[i]` was drafted from: conditioned on
      `tokens[:i]`). A drafter with other whole continuations (the n-gram drafter's shorter matches) may return them
      as `draft.branches` (each a `Draft` whose `confidence` applies as for a draft). Both are optional: without
      them the tree is the chain.

    * `request.constraint`: the sequence's structured-output state, or None. A drafter may follow it, picking
      its draft positions in order (the draft model, MTP and the block drafter do): mask each position with
      `constraint.next_mask()`, then `constraint.draft_step(token)` after picking; the Speculator undoes those
      steps after `propose`. A drafter that ignores it is still exact: drafts are cut at their first token the
      constraint refuses.

`observe(seq_id, first_position, hidden)` (called only when `needs_hidden` is True)
    After every pass, for every sequence the pass committed rows of: `hidden` [n, H] holds the
    target's final hidden states of those rows, at positions `first_position ..
    first_position + n - 1` (rows of rejected drafts are not among them). A drafter conditioned on
    the target (the MTP head) keeps what it needs; the tensor may be a view the next pass
    overwrites only after the next `propose`.

`on_commit(seq_id, accepted, num_tokens)`
    Called after each verify step for every sequence the drafter proposed for in that step
    (including steps where the policy verified another drafter's draft, or `max_tokens` was 0).
    `accepted` = how many leading tokens of this drafter's last draft for the sequence equal the
    tokens actually committed after the context it saw (when its own draft was verified, that is
    the number the verifier accepted); `num_tokens` = the sequence's new context length, i.e.
    `len(token_ids) + (committed tokens)`, including the target's own correction/bonus token.
    Drafters with caches keep exactly the first `len(token_ids) + accepted` positions and
    discard the rest. `num_tokens` may also be smaller than anything seen before (rollback:
    preemption, stop-string truncation): a drafter must then forget every state past
    `num_tokens`. The next `propose` for the sequence sees a context of length `num_tokens`
    (or longer, if steps ran without this drafter).

`on_finish(seq_id)`
    The sequence is done (finished, aborted or preempted without resume): free all its state.
    Idempotent; unknown ids are ignored (as they are in `on_commit`).

`state_bytes()`
    Memory currently held by the drafter's per-sequence state and caches, in bytes (device
    memory for neural drafters, host memory for n-gram) -- for the memory planner. An estimate
    is fine; it must grow with the held state and drop after `on_finish`.

`needs_hidden`: whether the drafter reads the target's hidden states (`observe`).

`target_layers` (optional; absent or empty = the final hidden states): target layers whose outputs (the
residual stream after each, un-normed) the drafter reads instead. The engine has every pass return them, and
`observe` then receives them side by side, [n, len(target_layers) * H], in this order (the block drafter).

Drafters are driven from the engine loop thread only; they need not be thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from deltaspec.sample.params import SamplingParams
    from deltaspec.sample.structured import GrammarState


@dataclass(slots=True)
class DraftRequest:
    """One sequence's drafting request: its whole context and the draft budget."""

    seq_id: str
    token_ids: list[int]  # prompt + generated, ending with the last sampled (not yet computed) token
    max_tokens: int  # at most this many draft tokens; 0 allowed
    params: SamplingParams | None = None  # the request's sampling; None or greedy: draft greedily
    constraint: GrammarState | None = None  # the sequence's structured-output state; None: unconstrained
    candidates: int = 0  # > 0: for a tree, report this many top candidates per position (module docstring)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


@dataclass(slots=True)
class Draft:
    """A drafter's proposal for one sequence (see the module docstring for the field contract)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] draft distributions; None = deterministic
    confidence: list[float] | None = None  # per token, in [0, 1]; None = no opinion
    candidates: list[list[tuple[int, float]]] | None = None  # per position: (token, probability), most likely first
    branches: list[Draft] | None = None  # other whole continuations of the context

    def __post_init__(self) -> None:
        probs = self.probs
        if probs is not None and (probs.dim() != 2 or probs.shape[0] != len(self.tokens)):
            raise ValueError(f"probs must be [len(tokens)={len(self.tokens)}, V], got {tuple(probs.shape)}")
        if self.confidence is not None and len(self.confidence) != len(self.tokens):
            raise ValueError(f"confidence has {len(self.confidence)} entries for {len(self.tokens)} tokens")
        if self.candidates is not None and len(self.candidates) != len(self.tokens):
            raise ValueError(f"candidates has {len(self.candidates)} positions for {len(self.tokens)} tokens")

    def __len__(self) -> int:
        return len(self.tokens)


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter. Implementations: `ngram` (deltaspec.spec.ngram), `mtp` (deltaspec.spec.mtp),
    `draft` (deltaspec.spec.draft_model), `block` (deltaspec.spec.block), a neural drafter with ngram
    (deltaspec.spec.combined), and the benchmarks' `oracle` (deltaspec.spec.oracle)."""

    name: str
    needs_hidden: bool

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One `Draft` per request, in order, each at most `max_tokens` long."""
        ...

    def observe(self, seq_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [n, H] of committed rows at positions first_position.. ."""
        ...

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        """`accepted` leading draft tokens were committed; the context is now `num_tokens` long."""
        ...

    def on_finish(self, seq_id: str) -> None:
        """Free all state of `seq_id` (idempotent)."""
        ...

    def state_bytes(self) -> int:
        """Bytes of per-sequence state and caches currently held."""
        ...
