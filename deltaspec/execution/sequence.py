"""A sequence: one request (`Request`: its prompt, its images, sampling parameters and constraint) and the tokens
generated for it, made of owned parts: the request, its place in the caches (`CacheHandle`, which the cache layer
receives), the drafts its next pass verifies (`Proposal`) and its statistics (`SequenceStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from deltaspec.cache.handle import CacheHandle
from deltaspec.execution.proposal import Proposal
from deltaspec.execution.request import Request
from deltaspec.execution.statistics import SequenceStats


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity, not field values, makes two sequences equal
class Sequence:
    request: Request
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None  # output text cut at a matched stop string
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    isolated_until: int = 0  # after a failed pass: run alone until this many tokens are computed (0: no)
    error: str | None = None  # why it failed, when finish_reason is "error"
    expected_cached: int = 0  # tokens a checkpoint held when the sequence arrived (a scheduling estimate)
    checkpoint_at: list[int] = field(default_factory=list)  # prompt positions to leave prefix checkpoints at
    cache: CacheHandle = field(default_factory=CacheHandle)  # its slot, pages, computed tokens, replay cursor
    proposal: Proposal = field(default_factory=Proposal)  # the drafts its next pass verifies
    stats: SequenceStats = field(default_factory=SequenceStats)  # its timings and acceptance

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """Its tokens as the prefix cache keys them: image tokens by their image's bytes (`PromptImages`)."""
        if self.request.images is None:
            return self.all_ids
        return [*self.request.images.cache_ids, *self.output_ids]

    @property
    def row_ids(self) -> list[int]:
        """Tokens the next passes feed: the sequence's own, then the drafts being verified."""
        return self.request.prompt_ids + self.output_ids + self.proposal.tokens

    def row_positions(self, rows: int) -> list[int]:
        """Positions of the next pass's `rows` rows: one after another, or for a tree of drafts each row's depth on
        from the last sampled token's position (its KV still fills the slots one after another)."""
        start = self.cache.num_computed
        parents = self.proposal.row_parents(rows)
        if parents is None:
            return list(range(start, start + rows))
        positions = [start]
        for parent in parents[1:]:
            positions.append(positions[parent] + 1)
        return positions

    def rope_positions(self, rows: int) -> list[int]:
        """The RoPE positions of the next pass's `rows` rows (`row_positions`, on the text streams of a prompt with
        images: `PromptImages.rope_position`)."""
        positions = self.row_positions(rows)
        return positions if self.request.images is None else [self.request.images.rope_position(p) for p in positions]

    @property
    def decoding(self) -> bool:
        """Prompt done and exactly one token (the last sampled) not yet computed."""
        return self.cache.num_computed == self.num_tokens - 1 and self.cache.num_computed >= len(
            self.request.prompt_ids
        )

    @property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the raw logits: greedy, no penalties, no logprobs, min_tokens met, no
        constraint."""
        p = self.request.params
        return (
            p.greedy
            and self.request.grammar is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
            and p.logprobs is None
            and len(self.output_ids) >= p.min_tokens
        )

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def remaining_prompt(self) -> int:
        return max(len(self.request.prompt_ids) - self.cache.num_computed, 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def metrics(self) -> dict:
        """Its token counts, time to first token, decode time and decode tok/s by DESIGN §6, and acceptance."""
        return {
            "arrival_time": self.stats.arrival_wall_time,
            "num_prompt_tokens": len(self.request.prompt_ids),
            "num_cached_tokens": self.cache.num_cached_tokens,
            "num_generated_tokens": len(self.output_ids),
            **self.stats.metrics(len(self.output_ids)),
        }
