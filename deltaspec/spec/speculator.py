"""Speculator (DESIGN §3, §5): everything speculative about a step, on behalf of the engine.

It owns the drafter (one drafter, or a neural one with n-gram behind `CombinedDrafter`), the draft-length
policy, verification (greedy from the pass's argmax, lossless rejection sampling from logits), the rollback
of rejected rows (through the cache manager, which alone moves the replay-log cursor), acceptance
statistics, and the drafter's notices (hidden states, commits, finishes).

Per step the engine calls `propose(running)` before scheduling; after the pass, `commit(outputs, append)`
with the outputs of the sequences that verified drafts (it verifies, rolls back, records, appends through
`append`, and tells the drafter), then `observe(outputs)` with every output. `finish(seq)` when a sequence
ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.errors import DeltaspecError
from deltaspec.execution.runner import SeqOutput
from deltaspec.execution.sequence import Sequence
from deltaspec.sample.logprobs import gather_logprobs
from deltaspec.spec.drafter import Drafter, DraftRequest
from deltaspec.spec.verify import VerifyResult, verify_greedy_tokens, verify_sampling

Append = Callable[[Sequence, list[int], list], None]  # (sequence, tokens, logprobs per token)


class DraftLength(Protocol):
    """How many tokens to draft for a sequence (`deltaspec.spec.policy`)."""

    def choose(self, seq_id: str, budget: int) -> int: ...

    def update(self, seq_id: str, drafted: int, accepted: int) -> None: ...

    def forget(self, seq_id: str) -> None: ...


def can_draft(seq: Sequence) -> bool:
    """A decoding sequence whose verify rows need no per-row penalty state: no penalties, min_tokens met."""
    params = seq.params
    return (
        seq.decoding
        and len(seq.output_ids) >= params.min_tokens
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
    )


class Speculator:
    def __init__(self, drafter: Drafter, policy: DraftLength, cache: CacheManager, max_model_len: int):
        if not isinstance(drafter, Drafter):
            raise DeltaspecError(
                f"{type(drafter).__name__} is not a Drafter: it needs name, needs_hidden, propose, "
                "observe, on_commit, on_finish and state_bytes (deltaspec.spec.drafter)."
            )
        self.drafter, self.policy, self.cache, self.max_model_len = drafter, policy, cache, max_model_len

    @property
    def name(self) -> str:
        return self.drafter.name

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for every running sequence that can use them, within its policy's length and its budget."""
        requests, seqs = [], []
        for seq in filter(can_draft, running):
            budget = min(seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1)
            k = self.policy.choose(seq.request_id, budget)
            if k > 0:
                requests.append(DraftRequest(seq.request_id, seq.all_ids, k, seq.params))
                seqs.append(seq)
        for seq, draft in zip(seqs, self.drafter.propose(requests) if requests else []):
            seq.draft, seq.draft_probs = list(draft.tokens), draft.probs

    def commit(self, outputs: list[SeqOutput], append: Append) -> None:
        """Verify the drafts of `outputs` (sequences that verified drafts this pass), keep each one's accepted
        rows, append the accepted drafts and the target's own token, and tell the drafter."""
        if not outputs:
            return
        verdicts = self._verify(outputs)
        for out, tokens, accepted in zip(outputs, verdicts.tokens, verdicts.accepted):
            seq, drafted = out.seq, len(out.seq.draft)
            self.cache.keep_verified(seq, 1 + accepted)  # the last sampled token's row and the accepted drafts
            seq.draft, seq.draft_probs = [], None
            seq.acceptance.record(drafted, accepted)
            self.policy.update(seq.request_id, drafted, accepted)
            logprobs = [None] * len(tokens)
            if seq.params.logprobs is not None:
                logprobs = gather_logprobs(
                    out.logits[: len(tokens)],
                    torch.tensor(tokens, device=out.logits.device),
                    [seq.params.logprobs] * len(tokens),
                )
            append(seq, tokens, logprobs)
            if not seq.finished:
                self.drafter.on_commit(seq.request_id, accepted, seq.num_tokens)

    def _verify(self, outputs: list[SeqOutput]) -> VerifyResult:
        """Greedy verification from the argmax for plain-greedy sequences, rejection sampling from the logits for
        the others; results in the order of `outputs`."""
        greedy = [out for out in outputs if out.logits is None]
        sampled = [out for out in outputs if out.logits is not None]
        by_argmax = verify_greedy_tokens([out.argmax for out in greedy], [out.seq.draft for out in greedy])
        by_sampling = verify_sampling(
            [out.logits for out in sampled],
            [out.seq.draft for out in sampled],
            [None if out.seq.draft_probs is None else out.seq.draft_probs[: len(out.seq.draft)] for out in sampled],
            [out.seq.params for out in sampled],
            [out.seq.generator for out in sampled],
        )
        found = {
            id(out): (tokens, accepted)
            for group, result in ((greedy, by_argmax), (sampled, by_sampling))
            for out, tokens, accepted in zip(group, result.tokens, result.accepted)
        }
        ordered = [found[id(out)] for out in outputs]
        return VerifyResult([tokens for tokens, _ in ordered], [accepted for _, accepted in ordered])

    def observe(self, outputs: list[SeqOutput]) -> None:
        """Hand a drafter that reads the target's hidden states those of every committed row."""
        if not self.drafter.needs_hidden:
            return
        for out in outputs:
            committed = out.seq.num_computed - out.first_position
            if not out.seq.finished and committed > 0:
                self.drafter.observe(out.seq.request_id, out.first_position, out.hidden[:committed])

    def finish(self, seq: Sequence) -> None:
        self.drafter.on_finish(seq.request_id)
        self.policy.forget(seq.request_id)

    def state_bytes(self) -> int:
        return self.drafter.state_bytes()
