"""`NgramDrafter`: prompt lookup decoding over each sequence's own context.

Rule (exactly what `propose` returns; the tests check it against a brute-force search):
for a context `t` of length `L`, take the largest `n` in `[min_n, max_n]` such that the suffix
`t[L-n:]` also occurs at an earlier start `p < L - n` (occurrences may overlap the suffix); of
those occurrences take the most recent (largest `p`) and draft the tokens that followed it,
`t[p+n : p+n+max_tokens]` -- never past the end of the context, so at least one token. No
suffix of length >= `min_n` recurring -> empty draft.

Confidence (a heuristic, not a calibrated probability): every token of a draft gets
`matched_n / max_n` (1.0 when the full `max_n`-gram matched). It is the same for all positions;
the policy combining drafters should weigh it against a neural drafter's own confidence and
draft length -- an n-gram draft must not blindly replace a longer neural draft.

For a tree of drafts (`DraftRequest.candidates` > 0) other continuations become branches (`Draft.branches`,
confidence `n / max_n`), so a tree keeps several alive: those after the `earlier` occurrences before the most recent
one of the longest match (a drafter made with `earlier` > 0 remembers that many per n-gram), then after the most
recent occurrences of the shorter suffixes that matched; each continuation that differs from those before it.

Index: per sequence and per `n`, a dict from n-gram tuple to the start of its most recent
occurrence among the n-grams that have a following token (those inside `t[:L-1]`). A call only
indexes the tokens appended since the previous call, so a decode step costs
O((max_n - min_n + 1) * new tokens) plus at most `max_n - min_n + 1` dict look-ups (matching is
monotone in `n`: if the `n`-gram suffix recurs, so does every shorter suffix, so the search goes
up from `min_n` and stops at the first miss).

Incremental indexing assumes the context only grows between calls (true in speculative decoding:
the next context is the previous one plus the committed tokens). Anything else is detected and
answered with a full rebuild from the given context: a shorter context, `on_commit` reporting
fewer tokens than indexed, or a mismatch in the last `check_window` indexed tokens (the prefix
the engine could have rewritten in place). `check_window=None` compares the whole indexed prefix
on every call (exact for arbitrary call sequences, O(L) per call).

Memory: roughly (max_n - min_n + 1) * ~150 bytes per context token on the host (tuple keys,
dict slots, position ints), reported by `state_bytes`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from deltaspec.spec.drafter import Draft, DraftRequest

_INT_BYTES = sys.getsizeof(10**6)  # a position int (not in the small-int cache)


@dataclass(slots=True)
class _SeqIndex:
    tokens: list[int] = field(default_factory=list)  # copy of the context seen by the last call
    maps: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # [n - min_n] -> {ngram: start}
    earlier: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)  # [n - min_n] -> {ngram: older
    # starts, most recent first}


class NgramDrafter:
    """Prompt lookup drafter (deterministic: drafts carry `probs=None`). See the module docstring."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 5, check_window: int | None = 16, earlier: int = 0):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if check_window is not None and check_window < 0:
            raise ValueError(f"check_window must be >= 0 or None, got {check_window}")
        self.min_n = min_n
        self.max_n = max_n
        self.check_window = check_window
        self.earlier = earlier
        self._seqs: dict[str, _SeqIndex] = {}
        self._tuple_bytes = [sys.getsizeof((0,) * n) for n in range(max_n + 1)]

    # -- Drafter protocol ---------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose_one(r) for r in requests]

    def observe(self, seq_id: str, first_position: int, hidden) -> None:
        """Not conditioned on the target's hidden states."""

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        st = self._seqs.get(seq_id)
        if st is not None and num_tokens < len(st.tokens):
            # Rollback below what was indexed: forget it; the next propose rebuilds from its context.
            del self._seqs[seq_id]

    def on_finish(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def state_bytes(self) -> int:
        total = 0
        for st in self._seqs.values():
            total += sys.getsizeof(st.tokens)
            for n, d in enumerate(st.maps, self.min_n):
                total += sys.getsizeof(d) + len(d) * (self._tuple_bytes[n] + _INT_BYTES)
            for d in st.earlier:
                total += sys.getsizeof(d) + sum(sys.getsizeof(s) + len(s) * _INT_BYTES for s in d.values())
        return total

    # -- internals ----------------------------------------------------------------------------

    def _propose_one(self, req: DraftRequest) -> Draft:
        t = req.token_ids
        st = self._sync(req.seq_id, t)
        L = len(t)
        if req.max_tokens <= 0:
            return Draft(tokens=[], probs=None, confidence=[])
        matches = []  # (n, start of its most recent occurrence), shortest first
        for n, d in enumerate(st.maps, self.min_n):
            if n >= L:  # an earlier occurrence needs a start p with 0 <= p < L - n
                break
            p = d.get(tuple(t[L - n :]))
            if p is None:
                break  # no longer suffix can recur either
            matches.append((n, p))
        if not matches:
            return Draft(tokens=[], probs=None, confidence=[])
        best = self._continuation(t, *matches[-1], req.max_tokens)
        if req.candidates:
            longest = matches[-1][0]
            older = st.earlier[longest - self.min_n].get(tuple(t[L - longest :]), []) if st.earlier else []
            seen, best.branches = {tuple(best.tokens)}, []
            for n, p in [(longest, p) for p in older] + list(reversed(matches[:-1])):
                other = self._continuation(t, n, p, req.max_tokens)
                if tuple(other.tokens) not in seen:
                    seen.add(tuple(other.tokens))
                    best.branches.append(other)
        return best

    def _continuation(self, t: list[int], n: int, p: int, max_tokens: int) -> Draft:
        """The tokens that followed the occurrence of the `n`-gram at `p`, with confidence n / max_n."""
        tokens = list(t[p + n : p + n + max_tokens])
        return Draft(tokens=tokens, probs=None, confidence=[n / self.max_n] * len(tokens))

    def _sync(self, seq_id: str, t: list[int]) -> _SeqIndex:
        """The index of `seq_id`, brought up to date with context `t`."""
        st = self._seqs.get(seq_id)
        if st is None or not self._extends(st.tokens, t):
            sizes = range(self.min_n, self.max_n + 1)
            st = _SeqIndex(maps=[{} for _ in sizes], earlier=[{} for _ in sizes] if self.earlier else [])
            self._seqs[seq_id] = st
        self._index(st, t)
        return st

    def _extends(self, old: list[int], t: list[int]) -> bool:
        m = len(old)
        if len(t) < m:
            return False
        w = m if self.check_window is None else min(m, self.check_window)
        return w == 0 or t[m - w : m] == old[m - w :]

    def _index(self, st: _SeqIndex, t: list[int]) -> None:
        """Index the n-grams of `t[:L-1]` not yet indexed (those ending after `len(st.tokens) - 1`)."""
        m, L = len(st.tokens), len(t)
        if L == m:
            return
        end = L - 1  # n-grams must end before the last token (they need a following token)
        for n, d in enumerate(st.maps, self.min_n):
            p0 = max(0, m - n)  # first start whose n-gram ends past the old region t[:m-1]
            count = end - n + 1 - p0
            if count <= 0:
                continue
            seg = t[p0:end]
            # zip of shifted views yields the n-gram tuples in order, so later starts overwrite
            # earlier ones: each key maps to its most recent occurrence.
            grams = zip(zip(*[seg[i:] for i in range(n)]), range(p0, p0 + count))
            if not self.earlier:
                d.update(grams)
                continue
            earlier = st.earlier[n - self.min_n]
            for gram, start in grams:
                previous = d.get(gram)
                if previous is not None:
                    starts = earlier.setdefault(gram, [])
                    starts.insert(0, previous)
                    del starts[self.earlier :]
                d[gram] = start
        st.tokens.extend(t[m:])
