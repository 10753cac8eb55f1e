"""A sequence: one prompt and the tokens generated for it, with its place in the caches and its drafting
statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from deltaspec.cache.replay import ReplayCursor
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.structured import GrammarState


@dataclass
class AcceptanceStats:
    """How a sequence's drafts fared: verify rounds, accepted drafts, and per draft position."""

    rounds: int = 0  # verify passes with at least one draft token
    accepted: int = 0  # draft tokens accepted in total
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: rounds whose draft i+1 was accepted
    drafted_at: list[int] = field(default_factory=list)  # drafted_at[i]: rounds that proposed a draft i+1

    def record(self, drafted: int, accepted: int) -> None:
        """One verify round: `drafted` drafts, the first `accepted` of them accepted."""
        self.rounds += 1
        self.accepted += accepted
        grow = drafted - len(self.drafted_at)
        self.drafted_at.extend([0] * max(grow, 0))
        self.accepted_at.extend([0] * max(grow, 0))
        for position in range(drafted):
            self.drafted_at[position] += 1
            self.accepted_at[position] += position < accepted

    def metrics(self) -> dict:
        if not self.rounds:
            return {}
        return dict(
            spec_rounds=self.rounds,
            spec_accepted_tokens=self.accepted,
            acceptance_length=self.accepted / self.rounds,
            tokens_per_round=self.accepted / self.rounds + 1,
            acceptance_per_position=[a / d for a, d in zip(self.accepted_at, self.drafted_at)],
            accepted_at=list(self.accepted_at),
            drafted_at=list(self.drafted_at),
        )


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity, not field values, makes two sequences equal
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    generator: torch.Generator | None = None
    seed: int | None = None  # the seed `generator` was made from
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    state_slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None  # output text cut at a matched stop string
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    arrival_wall_time: float = field(default_factory=time.time)
    enqueued_step: int = 0  # scheduler pass at which it last entered the waiting queue
    admitted_step: int = 0  # scheduler pass at which it last got its caches
    scheduled_step: int = 0  # scheduler pass that last gave it rows
    isolated_until: int = 0  # after a failed pass: run alone until this many tokens are computed (0: no)
    error: str | None = None  # why it failed, when finish_reason is "error"
    draft: list[int] = field(default_factory=list)  # draft tokens to verify in the next pass
    draft_probs: torch.Tensor | None = None  # [len(draft), V] drafter distributions (None: deterministic)
    draft_parents: list[int] | None = None  # a tree of drafts: draft j's parent row (0: the last sampled token's, i:
    # draft i - 1's; parents first), the pass's rows in that order; None: a chain
    replay: ReplayCursor = field(default_factory=ReplayCursor)  # moved by the cache manager only
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    num_cached_tokens: int = 0  # tokens resumed from a prefix checkpoint instead of computed
    expected_cached: int = 0  # tokens a checkpoint held when the sequence arrived (a scheduling estimate)
    checkpoint_at: list[int] = field(default_factory=list)  # prompt positions to leave prefix checkpoints at
    history_len: int = 0  # prompt tokens a follow-up will share: a chat's history without its generation prompt
    grammar: GrammarState | None = None  # where its output stands in its structured_outputs constraint

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def row_ids(self) -> list[int]:
        """Tokens the next passes feed: the sequence's own, then the drafts being verified."""
        return self.prompt_ids + self.output_ids + self.draft

    def row_parents(self, rows: int) -> list[int] | None:
        """The parents of the next pass's `rows` rows (`deltaspec.ops.layout.TreeRows`) when they verify a tree of
        drafts, None for a chain."""
        if self.draft_parents is None or rows != 1 + len(self.draft):
            return None
        return [-1, *self.draft_parents]

    def row_positions(self, rows: int) -> list[int]:
        """Positions of the next pass's `rows` rows: one after another, or for a tree of drafts each row's depth on
        from the last sampled token's position (its KV still fills the slots one after another)."""
        start = self.num_computed
        parents = self.row_parents(rows)
        if parents is None:
            return list(range(start, start + rows))
        positions = [start]
        for parent in parents[1:]:
            positions.append(positions[parent] + 1)
        return positions

    def kv_slots(self, positions: list[int], block_size: int) -> list[int]:
        """The flat KV cache slots (page * block_size + offset) of the sequence's tokens at `positions`."""
        return [self.blocks[p // block_size] * block_size + p % block_size for p in positions]

    def cut_draft(self, keep: int) -> None:
        """Keep the first `keep` drafts (a tree's first nodes keep their parents), with their distributions."""
        del self.draft[keep:]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:keep] if keep else None
        if self.draft_parents is not None:
            self.draft_parents = self.draft_parents[:keep] if keep else None

    @property
    def decoding(self) -> bool:
        """Prompt done and exactly one token (the last sampled) not yet computed."""
        return self.num_computed == self.num_tokens - 1 and self.num_computed >= len(self.prompt_ids)

    @property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the raw logits: greedy, no penalties, no logprobs, min_tokens met, no
        constraint."""
        p = self.params
        return (
            p.greedy
            and self.grammar is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
            and p.logprobs is None
            and len(self.output_ids) >= p.min_tokens
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_prompt(self) -> int:
        return max(len(self.prompt_ids) - self.num_computed, 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def metrics(self) -> dict:
        """Time to first token, decode time and decode tok/s by DESIGN §6."""
        n_new = len(self.output_ids)
        out = {
            "arrival_time": self.arrival_wall_time,
            "num_prompt_tokens": len(self.prompt_ids),
            "num_cached_tokens": self.num_cached_tokens,
            "num_generated_tokens": n_new,
            "time_to_first_token": None,
            "decode_time": None,
            "decode_tok_s": None,
            "time_per_output_token": None,
        }
        if self.first_token_time is not None:
            out["time_to_first_token"] = self.first_token_time - self.arrival_time
        if self.first_token_time is not None and self.finish_time is not None:
            decode_time = self.finish_time - self.first_token_time
            out["decode_time"] = decode_time
            if n_new > 1 and decode_time > 0:
                out["decode_tok_s"] = (n_new - 1) / decode_time
                out["time_per_output_token"] = decode_time / (n_new - 1)
        out.update(self.acceptance.metrics())
        return out
