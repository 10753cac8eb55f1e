"""`CombinedDrafter`: a neural drafter and the n-gram drafter behind one policy.

The n-gram drafter answers first (it is free). A sequence whose n-gram draft is a full-length,
full-confidence match (the longest n-gram matched and the continuation fills the whole budget)
uses it and skips the neural drafter this round; every other sequence uses the neural draft, so an
n-gram hit never replaces a longer neural draft. Measured on the embedded model (docs/speculative.md, `bench
spec`): full n-gram matches are accepted about as well as the draft model's drafts (AL 3.26 against
3.25 at k = 7) but cost no draft-model passes, while partial matches are worse than the model.
The neural drafter catches up on skipped rounds at its next call; both drafters hear every commit. For a tree of
drafts (`DraftRequest.candidates`), a neural draft carries the n-gram draft and its branches as branches of its own.
"""

from __future__ import annotations

from deltaspec.spec.drafter import Draft, Drafter, DraftRequest


class CombinedDrafter:
    def __init__(self, neural: Drafter, ngram: Drafter):
        self.neural, self.ngram = neural, ngram
        self.name = f"{neural.name}+{ngram.name}"
        self.needs_hidden = neural.needs_hidden or ngram.needs_hidden
        self.target_layers = tuple(getattr(neural, "target_layers", ()))

    def observe(self, seq_id: str, first_position: int, hidden) -> None:
        for drafter in (self.neural, self.ngram):
            if drafter.needs_hidden:
                drafter.observe(seq_id, first_position, hidden)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        lookup = self.ngram.propose(requests)

        def full_match(req: DraftRequest, draft: Draft) -> bool:
            greedy = req.params is None or req.params.greedy  # sampled requests need the model's q
            return (
                greedy
                and req.max_tokens > 0
                and len(draft.tokens) == req.max_tokens
                and draft.confidence is not None
                and min(draft.confidence) >= 1.0
            )

        use_ngram = [full_match(req, draft) for req, draft in zip(requests, lookup)]
        neural = iter(self.neural.propose([r for r, n in zip(requests, use_ngram) if not n]))
        drafts = []
        for req, draft, n in zip(requests, lookup, use_ngram):
            if n:
                drafts.append(Draft(tokens=list(draft.tokens), branches=draft.branches))
                continue
            mine = next(neural)
            if req.candidates and draft.tokens:
                mine.branches = [draft, *(draft.branches or ())]
            drafts.append(mine)
        return drafts

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        self.neural.on_commit(seq_id, accepted, num_tokens)
        self.ngram.on_commit(seq_id, accepted, num_tokens)

    def on_finish(self, seq_id: str) -> None:
        self.neural.on_finish(seq_id)
        self.ngram.on_finish(seq_id)

    def state_bytes(self) -> int:
        return self.neural.state_bytes() + self.ngram.state_bytes()
