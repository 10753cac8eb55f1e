"""`Proposal`: the part of a sequence that holds the drafts its next pass verifies, written by the speculator and
cut by the scheduler: the draft tokens, the drafter's distributions, and for a tree of drafts each one's parent."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)  # draft tokens to verify in the next pass
    probs: torch.Tensor | None = None  # [len(tokens), V] drafter distributions (None: deterministic)
    parents: list[int] | None = None  # a tree of drafts: draft j's parent row (0: the last sampled token's, i:
    # draft i - 1's; parents first), the pass's rows in that order; None: a chain

    def row_parents(self, rows: int) -> list[int] | None:
        """The parents of the next pass's `rows` rows (`deltaspec.ops.layout.TreeRows`) when they verify a tree of
        drafts, None for a chain."""
        if self.parents is None or rows != 1 + len(self.tokens):
            return None
        return [-1, *self.parents]

    def cut(self, keep: int) -> None:
        """Keep the first `keep` drafts (a tree's first nodes keep their parents), with their distributions."""
        del self.tokens[keep:]
        if self.probs is not None:
            self.probs = self.probs[:keep] if keep else None
        if self.parents is not None:
            self.parents = self.parents[:keep] if keep else None
