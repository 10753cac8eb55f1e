"""`CombinedDrafter`: a neural drafter and the n-gram drafter behind one policy.

Both propose for every sequence. The neural draft is used unless the n-gram draft is a full-length
match (confidence 1: the longest n-gram matched) that is at least as long AND the neural draft is
shorter than the budget; an n-gram match never blindly replaces a longer or equally long neural
draft (the failure the Thor write-up measured: a 4-token match replacing an 11-token block draft).
Both drafters hear every commit, so their caches follow the sequence.
"""

from __future__ import annotations

from deltaspec.spec.drafter import Draft, Drafter, DraftRequest


class CombinedDrafter:
    def __init__(self, neural: Drafter, ngram: Drafter):
        self.neural, self.ngram = neural, ngram
        self.name = f"{neural.name}+{ngram.name}"

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        neural = self.neural.propose(requests)
        lookup = self.ngram.propose(requests)
        chosen = []
        for req, a, b in zip(requests, neural, lookup):
            full_match = bool(b.tokens) and b.confidence is not None and min(b.confidence) >= 1.0
            prefer_ngram = full_match and len(b.tokens) > len(a.tokens) and (req.params is None or req.params.greedy)
            chosen.append(Draft(tokens=list(b.tokens)) if prefer_ngram else a)
        return chosen

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        self.neural.on_commit(seq_id, accepted, num_tokens)
        self.ngram.on_commit(seq_id, accepted, num_tokens)

    def on_finish(self, seq_id: str) -> None:
        self.neural.on_finish(seq_id)
        self.ngram.on_finish(seq_id)

    def state_bytes(self) -> int:
        return self.neural.state_bytes() + self.ngram.state_bytes()
