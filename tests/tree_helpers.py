"""Trees of drafts in tests: a tree with restarts, random trees, root-to-row paths (the kernels' tests check each
tree row against its path run as a chain), and `BranchingDrafter`, a drafter that hides the target's greedy
continuation in a tree so that every accepted path leaves the drafter's own chain (tree rows, restarts of the
recurrence, folds of a path and KV moves all run)."""

from __future__ import annotations

import torch

from deltaspec.spec.drafter import Draft

# Row parents of a tree with restarts: row 1 has two children (2, 3) that both have children (4, 5); 4, 5 and 7 are
# leaves.
TREE = [-1, 0, 1, 1, 2, 3, 0, 6]


def random_parents(rows: int, seed: int) -> list[int]:
    """A random tree of `rows` rows in row order: each row's parent is an earlier row."""
    generator = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, row, (1,), generator=generator)) for row in range(1, rows)]


def root_path(parents: list[int], row: int) -> list[int]:
    """The rows from the root to `row`, in order."""
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class BranchingDrafter:
    """Knows the target's greedy continuation and hides it in a tree: its own chain is right for `right` tokens, then
    wrong; a branch (or the second candidate at every position, with `as_candidates`) carries the truth, so the
    accepted path leaves the chain and the tree's rows, folds and KV moves are exercised."""

    name = "branching"
    needs_hidden = False

    def __init__(self, truth: dict[tuple, list[int]], right: int, vocab: int, as_candidates: bool = False):
        self.truth, self.right, self.vocab, self.as_candidates = truth, right, vocab, as_candidates

    def propose(self, requests):
        drafts = []
        for req in requests:
            prompt = next(p for p in self.truth if tuple(req.token_ids[: len(p)]) == p)
            done = len(req.token_ids) - len(prompt)
            truth = self.truth[prompt][done : done + req.max_tokens]
            chain = [t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(truth)]
            if self.as_candidates:
                candidates = [[(c, 0.6), (t, 0.35)] if c != t else [(c, 0.9)] for c, t in zip(chain, truth)]
                drafts.append(Draft(chain, candidates=candidates))
            else:
                drafts.append(Draft(chain, branches=[Draft(truth)] if truth != chain else None))
        return drafts

    def observe(self, seq_id, first_position, hidden):
        pass

    def on_commit(self, seq_id, accepted, num_tokens):
        pass

    def on_finish(self, seq_id):
        pass

    def state_bytes(self):
        return 0
