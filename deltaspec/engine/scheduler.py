"""Scheduler: which sequences run in the next forward pass, and how many rows each brings.

Every pass carries all runnable sequences together (DESIGN §3), within a budget of
`max_num_batched_tokens` rows:

1. one decode row for every running sequence whose prompt is done, plus its draft tokens to verify;
2. prompt chunks, at most `prefill_chunk` rows per sequence per pass, so a long prompt delays the
   others by at most one chunk. Prefills already running and waiting sequences are ordered
   together by remaining prompt (for a waiting sequence, what its prefix checkpoint would leave),
   shortest first, with aging: a sequence's remaining work counts
   half as much for every `aging_steps` passes it has been in the engine, so long prompts are
   not starved;
3. a waiting sequence is admitted when a GDN state slot and its pages are free; with prefix
   caching it may resume from a checkpoint, and a long prompt's chunks end exactly at the
   positions where it leaves checkpoints of its own (512 and 64 tokens before its end).

When the KV pages run out for a running sequence, the most recently admitted other sequence is
preempted: its caches are freed and it is recomputed later from its tokens (a GDN state cannot be
truncated, so recompute is the only way back).
"""

from __future__ import annotations

from collections import deque

from deltaspec.cache.manager import CacheManager
from deltaspec.errors import DeltaspecError
from deltaspec.execution.batch import Scheduled
from deltaspec.execution.sequence import Sequence, Status

CHECKPOINT_OFFSETS = (512, 64)  # a long prompt leaves prefix checkpoints this many tokens before its end


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_batched_tokens: int,
        prefill_chunk: int,
        aging_steps: int = 16,
        checkpoint_min_prompt: int = 0,
    ):
        self.cache = cache
        self.checkpoint_min_prompt = checkpoint_min_prompt  # 0: no prompt checkpoints
        self.budget = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.aging_steps = aging_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.enqueued_step = self.step_count
        if self.cache.prefix is not None:  # a follow-up's remaining work is what its checkpoint leaves
            found = self.cache.prefix.lookup(seq.all_ids, touch=False)
            seq.expected_cached = len(found.tokens) if found is not None else 0
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _priority(self, seq: Sequence) -> float:
        age = self.step_count - seq.enqueued_step
        done = seq.num_computed if seq.status is Status.RUNNING else max(seq.num_computed, seq.expected_cached)
        return (seq.num_tokens - done) / 2 ** (age / self.aging_steps)

    def _preempt_for(self, needy: Sequence) -> bool:
        """Free the pages of the most recently admitted other running sequence; False if none."""
        victims = [s for s in self.running if s is not needy]
        if not victims:
            return False
        victim = max(victims, key=lambda s: s.admitted_step)
        self.running.remove(victim)
        self.cache.release(victim)
        victim.num_computed = 0
        victim.draft.clear()
        victim.status = Status.WAITING
        victim.enqueued_step = self.step_count
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return True

    def _checkpoint_positions(self, seq: Sequence) -> list[int]:
        """Where a long prompt leaves prefix checkpoints: 512 and 64 tokens before its end, past what is computed."""
        length = len(seq.prompt_ids)
        if not self.checkpoint_min_prompt or self.cache.prefix is None or length < self.checkpoint_min_prompt:
            return []
        return [p for p in (length - CHECKPOINT_OFFSETS[0], length - CHECKPOINT_OFFSETS[1]) if p > seq.num_computed]

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Rows of `seq`'s next prompt chunk: within the chunk limit and the budget, ending at its next
        checkpoint position if it has one."""
        rows = min(seq.num_tokens - seq.num_computed, self.prefill_chunk, budget)
        if seq.checkpoint_at:
            rows = min(rows, seq.checkpoint_at[0] - seq.num_computed)
        return rows

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        while not self.cache.reserve(seq, num_tokens):
            if not self._preempt_for(seq):
                return False
        return True

    def schedule(self) -> list[Scheduled]:
        self.step_count += 1
        budget = self.budget
        batch: list[Scheduled] = []
        for seq in [s for s in self.running if s.remaining_prompt == 0 and s.num_computed < s.num_tokens]:
            if budget == 0:
                break
            del seq.draft[budget - 1 :]  # a draft never takes more rows than the pass has left
            rows = 1 + len(seq.draft)
            if seq in self.running and self._reserve(seq, seq.num_computed + rows):
                batch.append(Scheduled(seq, rows))
                budget -= rows
        scheduled = {id(item.seq) for item in batch}
        prefills = [s for s in self.running if id(s) not in scheduled and s.num_computed < s.num_tokens]
        candidates = sorted([*prefills, *self.waiting], key=self._priority)
        for seq in candidates:
            if budget == 0:
                break
            if seq.status is Status.WAITING:
                if not self.cache.can_admit():
                    continue
                self.cache.admit(seq)
                seq.checkpoint_at = self._checkpoint_positions(seq)
                rows = self._chunk(seq, budget)
                if not self.cache.reserve(seq, seq.num_computed + rows):
                    self.cache.release(seq)
                    seq.num_computed = seq.num_cached_tokens = 0
                    continue
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                seq.admitted_step = self.step_count
                self.running.append(seq)
            else:
                rows = self._chunk(seq, budget)
                if seq not in self.running or not self._reserve(seq, seq.num_computed + rows):
                    continue
            batch.append(Scheduled(seq, rows))
            budget -= rows
        batch = [item for item in batch if item.seq in self.running]
        if not batch and self.has_unfinished():
            raise DeltaspecError(
                "The KV cache is too small for even one sequence's next chunk; "
                "raise --num-kv-blocks or lower --max-model-len."
            )
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)
