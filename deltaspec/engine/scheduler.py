"""Scheduler: which sequences run in the next forward pass, and how many rows each brings.

Every pass carries all runnable sequences together (DESIGN §3), within a budget of
`max_num_batched_tokens` rows:

1. one decode row for every running sequence whose prompt is done (those that waited longest first,
   should the budget not reach them all), preempting others for pages when needed;
2. then the draft tokens of those sequences, within the rows left and the pages at hand: a draft is
   shortened or dropped to fit, never the reason for a preemption or for another sequence's row;
3. prompt chunks, at most `prefill_chunk` rows per sequence per pass, so a long prompt delays the
   others by at most one chunk. Prefills already running and waiting sequences are ordered
   together by remaining prompt (for a waiting sequence, what its prefix checkpoint would leave),
   shortest first, with aging: a sequence's remaining work counts
   half as much for every `aging_steps` passes it has been in the engine, so long prompts are
   not starved;
4. a waiting sequence is admitted when a GDN state slot and its pages are free; with prefix
   caching it may resume from a checkpoint, and a long prompt's chunks end exactly at the
   positions where it leaves checkpoints of its own (512 and 64 tokens before its end).

When the KV pages run out for a running sequence, the most recently admitted other sequence is
preempted: its caches are freed and it is recomputed later from its tokens (a GDN state cannot be
truncated, so recompute is the only way back). After a pass fails, its sequences are recomputed the
same way, each alone in its passes until it is past the point of the failure (`quarantine`), so the
one at fault fails alone and the others go on. A sequence that cannot get pages even alone is
returned in `unfit` for the engine to fail, never stopping the others.
"""

from __future__ import annotations

from collections import deque

from deltaspec.cache.manager import CacheManager
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
        self.unfit: list[Sequence] = []  # sequences the last `schedule` could not give pages even alone

    def add(self, seq: Sequence) -> None:
        seq.stats.enqueued_step = self.step_count
        if self.cache.prefix is not None:  # a follow-up's remaining work is what its checkpoint leaves
            found = self.cache.prefix.lookup(seq.cache_ids, touch=False)
            seq.expected_cached = len(found.tokens) if found is not None else 0
        self.waiting.append(seq)

    def usage(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            "steps": self.step_count,
        }

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _priority(self, seq: Sequence) -> float:
        age = self.step_count - seq.stats.enqueued_step
        done = (
            seq.cache.num_computed if seq.status is Status.RUNNING else max(seq.cache.num_computed, seq.expected_cached)
        )
        return (seq.num_tokens - done) / 2 ** (age / self.aging_steps)

    def _preempt_for(self, needy: Sequence) -> bool:
        """Free the pages of the most recently admitted other running sequence; False if none."""
        victims = [s for s in self.running if s is not needy]
        if not victims:
            return False
        self._requeue(max(victims, key=lambda s: s.stats.admitted_step))
        self.num_preemptions += 1
        return True

    def _requeue(self, seq: Sequence) -> None:
        """Free a running sequence's caches and put it first in the queue, to recompute from its tokens."""
        self.running.remove(seq)
        self.cache.release(seq.cache)
        seq.cache.num_computed = 0
        seq.proposal.cut(0)
        seq.status = Status.WAITING
        seq.stats.enqueued_step = self.step_count
        self.waiting.appendleft(seq)

    def quarantine(self, schedule: list[Scheduled]) -> None:
        """The pass of `schedule` failed: its sequences' states are unknown. Each recomputes, alone in its passes
        until it is past the rows of the failed pass."""
        for item in reversed(schedule):
            seq = item.seq
            if seq in self.running:
                seq.isolated_until = max(1, min(seq.cache.num_computed + item.num_rows, seq.num_tokens))
                self._requeue(seq)

    def long_prompt(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt is long enough to leave checkpoints before its end and evict older ones for them."""
        return bool(self.checkpoint_min_prompt) and len(seq.request.prompt_ids) >= self.checkpoint_min_prompt

    def may_evict_for(self, seq: Sequence, position: int) -> bool:
        """Whether `seq`'s checkpoint at `position` may evict an older one: where its chat's next turn parts from it
        (however short the turns: that is where a conversation resumes), and anywhere in a long prompt."""
        return position == seq.request.history_len or self.long_prompt(seq)

    def _checkpoint_positions(self, seq: Sequence) -> list[int]:
        """Where a prompt leaves prefix checkpoints, past what is computed: where its chat's next turn will part from
        it (`Request.history_len`), and for a long prompt 512 and 64 tokens before its end."""
        length = len(seq.request.prompt_ids)
        if self.cache.prefix is None:
            return []
        positions = {seq.request.history_len} if 0 < seq.request.history_len < length else set()
        if self.long_prompt(seq):
            positions |= {length - offset for offset in CHECKPOINT_OFFSETS}
        return sorted(p for p in positions if p > seq.cache.num_computed)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Rows of `seq`'s next prompt chunk: within the chunk limit and the budget, ending at its next
        checkpoint position if it has one."""
        rows = min(seq.num_tokens - seq.cache.num_computed, self.prefill_chunk, budget)
        if seq.checkpoint_at:
            rows = min(rows, seq.checkpoint_at[0] - seq.cache.num_computed)
        return rows

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        while not self.cache.reserve(seq.cache, num_tokens):
            if not self._preempt_for(seq):
                return False
        return True

    def schedule(self) -> list[Scheduled]:
        self.step_count += 1
        self.unfit = []
        suspect = next((s for s in [*self.running, *self.waiting] if s.isolated_until), None)
        if suspect is not None:
            return self._alone(suspect)
        batch = self._decode_rows()
        budget = self.budget - sum(item.num_rows for item in batch)
        scheduled = {id(item.seq) for item in batch}
        prefills = [s for s in self.running if id(s) not in scheduled and s.cache.num_computed < s.num_tokens]
        batch += self._admit_and_chunk(sorted([*prefills, *self.waiting], key=self._priority), budget)
        batch = [item for item in batch if item.seq in self.running]
        for item in batch:
            item.seq.stats.scheduled_step = self.step_count
        return batch

    def _decode_rows(self) -> list[Scheduled]:
        """One row for each decoding sequence, then its draft rows as far as the budget and free pages allow."""
        decoding = [s for s in self.running if s.remaining_prompt == 0 and s.cache.num_computed < s.num_tokens]
        batch: list[Scheduled] = []
        for seq in sorted(decoding, key=lambda s: s.stats.scheduled_step):
            if len(batch) < self.budget and seq in self.running and self._reserve(seq, seq.cache.num_computed + 1):
                batch.append(Scheduled(seq, 1))
        batch = [item for item in batch if item.seq in self.running]  # a later one's pages may have preempted it
        budget = self.budget - len(batch)
        chosen = {id(item.seq) for item in batch}
        for seq in decoding:
            if id(seq) not in chosen:
                seq.proposal.cut(0)  # not in this pass: its draft is for a pass that does not happen
        for item in batch:
            seq = item.seq
            k = min(len(seq.proposal.tokens), budget)
            while k and not self.cache.fits_without_eviction(seq.cache, seq.cache.num_computed + 1 + k):
                k -= 1
            self.cache.reserve(seq.cache, seq.cache.num_computed + 1 + k)
            seq.proposal.cut(k)
            item.num_rows = 1 + k
            budget -= k
        return batch

    def _alone(self, seq: Sequence) -> list[Scheduled]:
        """A pass of `seq` alone (a suspect of a failed pass): its next chunk, or one decode row without drafts;
        others give up their slot or pages when it needs them."""
        if seq.status is Status.WAITING:
            while not self.cache.can_admit() and self._preempt_for(seq):
                pass
            if not self.cache.can_admit():
                self.unfit.append(seq)
                return []
            self.cache.admit(seq.cache, seq.cache_ids, resume=seq.request.params.prompt_logprobs is None)
            seq.checkpoint_at = self._checkpoint_positions(seq)
            self._start(seq)
        seq.proposal.cut(0)
        rows = self._chunk(seq, self.budget)
        if not self._reserve(seq, seq.cache.num_computed + rows):
            self.unfit.append(seq)
            return []
        seq.stats.scheduled_step = self.step_count
        return [Scheduled(seq, rows)]

    def _start(self, seq: Sequence) -> None:
        """A waiting sequence that has its caches runs from now on."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.stats.admitted_step = self.step_count
        self.running.append(seq)

    def _admit_and_chunk(self, candidates: list[Sequence], budget: int) -> list[Scheduled]:
        """Prompt chunks for `candidates` in order, admitting waiting ones, within `budget` rows. A candidate
        that gets no pages while nothing else runs goes to `unfit`."""
        batch: list[Scheduled] = []
        for seq in candidates:
            if budget == 0:
                break
            if seq.status is Status.WAITING:
                if not self.cache.can_admit():
                    continue
                self.cache.admit(seq.cache, seq.cache_ids, resume=seq.request.params.prompt_logprobs is None)
                seq.checkpoint_at = self._checkpoint_positions(seq)
                rows = self._chunk(seq, budget)
                if not self.cache.reserve(seq.cache, seq.cache.num_computed + rows):
                    self.cache.release(seq.cache)
                    seq.cache.num_computed = seq.cache.num_cached_tokens = 0
                    if not self.running and not batch:
                        self.unfit.append(seq)
                    continue
                self._start(seq)
            else:
                rows = self._chunk(seq, budget)
                if seq not in self.running or not self._reserve(seq, seq.cache.num_computed + rows):
                    if seq in self.running and len(self.running) == 1:
                        self.unfit.append(seq)
                    continue
            batch.append(Scheduled(seq, rows))
            budget -= rows
        return batch

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.cache)
