"""The replay-log cursor of one sequence (DESIGN §4): which of its computed rows are not yet in its GDN state.

A pass either advances a sequence's state through its rows, or, for rows being verified, computes their
outputs from the state and writes each row's inputs to the slot's replay log instead (`logged`). After
verification the first `kept` logged rows stand (the last sampled token's row and the accepted drafts);
the next pass replays them onto the state before its own rows (`pending_fold`) and the rest are dropped.
A sequence has consumed `num_computed - unfolded` tokens into its state.

The cursor's fields are written here only, by the named transitions below; the cache manager drives them
(`CacheManager.after_pass`, `keep_verified`, `admit`, `release`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplayCursor:
    pending_fold: int = 0  # accepted log rows the next pass replays onto the state before its own rows
    logged: int = 0  # rows the last pass wrote to the log, not yet verified

    @property
    def unfolded(self) -> int:
        """Computed rows not yet in the state: accepted but unfolded, or logged and unverified."""
        return self.pending_fold + self.logged

    def after_pass(self, rows: int, logged: bool, verifying: bool) -> None:
        """A pass replayed what was pending, then ran `rows` rows: onto the state, or into the log when
        `logged`. Logged rows of a sequence that is not `verifying` drafts (a decode row run inside a
        verify pass) stand as they are and fold next pass."""
        self.pending_fold, self.logged = 0, 0
        if logged and verifying:
            self.logged = rows
        elif logged:
            self.pending_fold = rows

    def keep(self, kept: int) -> int:
        """Of the rows the last pass logged, the first `kept` stand and fold next pass; returns how many were
        dropped (rejected drafts)."""
        if not 0 <= kept <= self.logged:
            raise ValueError(f"cannot keep {kept} of {self.logged} logged rows")
        dropped = self.logged - kept
        self.pending_fold, self.logged = kept, 0
        return dropped

    def reset(self) -> None:
        """The slot starts over (a new or preempted sequence): nothing logged, nothing to fold."""
        self.pending_fold, self.logged = 0, 0
