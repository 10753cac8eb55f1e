"""The replay-log cursor of one sequence (DESIGN §4): which of its computed rows are not yet in its GDN state.

A pass either advances a sequence's state through its rows, or, for rows being verified, computes their
outputs from the state and writes each row's inputs to the slot's replay log instead (`logged`). After
verification the first `kept` logged rows stand (the last sampled token's row and the accepted drafts);
the next pass replays them onto the state before its own rows (`pending_fold`) and the rest are dropped.
A sequence has consumed `num_computed - unfolded` tokens into its state. After a tree of drafts the rows that
stand are the accepted path's, not the first ones: `fold_rows` lists them (None: rows 0..pending_fold-1).

The cursor's fields are written here only, by the named transitions below; the cache manager drives them
(`CacheManager.after_pass`, `keep_verified`, `admit`, `release`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplayCursor:
    pending_fold: int = 0  # accepted log rows the next pass replays onto the state before its own rows
    logged: int = 0  # rows the last pass wrote to the log, not yet verified
    fold_rows: list[int] | None = None  # the log rows the next pass replays, in order; None: 0..pending_fold-1

    @property
    def unfolded(self) -> int:
        """Computed rows not yet in the state: accepted but unfolded, or logged and unverified."""
        return self.pending_fold + self.logged

    def after_pass(self, rows: int, logged: bool, verifying: bool) -> None:
        """A pass replayed what was pending, then ran `rows` rows: onto the state, or into the log when
        `logged`. Logged rows of a sequence that is not `verifying` drafts (a decode row run inside a
        verify pass) stand as they are and fold next pass."""
        self.pending_fold, self.logged, self.fold_rows = 0, 0, None
        if logged and verifying:
            self.logged = rows
        elif logged:
            self.pending_fold = rows

    def keep(self, kept: int | list[int]) -> int:
        """Of the rows the last pass logged, the first `kept` stand and fold next pass, or the rows `kept` (a tree's
        accepted path: ascending, from row 0); returns how many were dropped (rejected drafts)."""
        rows = list(range(kept)) if isinstance(kept, int) else list(kept)
        if any(not 0 <= r < self.logged for r in rows) or rows != sorted(set(rows)) or (rows and rows[0]):
            raise ValueError(f"cannot keep rows {rows} of {self.logged} logged rows")
        dropped = self.logged - len(rows)
        self.pending_fold, self.logged = len(rows), 0
        self.fold_rows = None if rows == list(range(len(rows))) else rows
        return dropped

    def reset(self) -> None:
        """The slot starts over (a new or preempted sequence): nothing logged, nothing to fold."""
        self.pending_fold, self.logged, self.fold_rows = 0, 0, None
