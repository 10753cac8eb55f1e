"""`BranchingDrafter`: a test drafter that hides the target's greedy continuation in a tree of drafts, so that every
accepted path leaves the drafter's own chain (tree rows, restarts of the recurrence, folds of a path and KV moves
all run)."""

from __future__ import annotations

from deltaspec.spec.drafter import Draft


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
