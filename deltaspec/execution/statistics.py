"""The statistics part of a sequence: when it arrived, entered the queue, got its caches, was last scheduled,
produced its first and last token (`SequenceStats`), and how its drafts fared (`AcceptanceStats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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


@dataclass
class SequenceStats:
    arrival_time: float = field(default_factory=time.perf_counter)
    arrival_wall_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    enqueued_step: int = 0  # scheduler pass at which it last entered the waiting queue
    admitted_step: int = 0  # scheduler pass at which it last got its caches
    scheduled_step: int = 0  # scheduler pass that last gave it rows
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    def metrics(self, num_generated: int) -> dict:
        """Time to first token, decode time, decode tok/s and time per output token by DESIGN §6 (None until
        known), and the acceptance statistics, for a sequence that generated `num_generated` tokens."""
        out = {
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
            if num_generated > 1 and decode_time > 0:
                out["decode_tok_s"] = (num_generated - 1) / decode_time
                out["time_per_output_token"] = decode_time / (num_generated - 1)
        out.update(self.acceptance.metrics())
        return out
