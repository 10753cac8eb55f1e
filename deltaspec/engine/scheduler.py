"""Scheduler: which sequences run in the next forward pass, and how many rows each brings.

Every pass carries all runnable sequences together (DESIGN §3): first one decode row for each
running sequence whose prompt is done, then prompt chunks of sequences still prefilling, then
newly admitted sequences, all within a budget of `max_num_batched_tokens` rows. A prompt longer
than the budget is prefilled in chunks over several passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deltaspec.cache.manager import CacheManager
from deltaspec.engine.sequence import Sequence, Status
from deltaspec.errors import DeltaspecError


@dataclass
class Scheduled:
    seq: Sequence
    num_rows: int

    @property
    def completes_prompt(self) -> bool:
        """After this pass the sequence has computed all of its tokens and samples a new one."""
        return self.seq.num_computed + self.num_rows >= self.seq.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_batched_tokens: int):
        self.cache = cache
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.budget
        batch: list[Scheduled] = []
        for seq in sorted(self.running, key=lambda s: s.remaining_prompt > 0):
            if budget == 0:
                break
            rows = min(seq.num_tokens - seq.num_computed, budget)
            if self.cache.reserve(seq, seq.num_computed + rows):
                batch.append(Scheduled(seq, rows))
                budget -= rows
        while self.waiting and budget > 0 and self.cache.can_admit():
            seq = self.waiting[0]
            rows = min(seq.num_tokens, budget)
            self.cache.admit(seq)
            if not self.cache.reserve(seq, rows):
                self.cache.release(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, rows))
            budget -= rows
        if not batch and self.has_unfinished():
            raise DeltaspecError("The KV cache is too small for even one sequence's next chunk; "
                                 "raise --num-kv-blocks or lower --max-model-len.")
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)
