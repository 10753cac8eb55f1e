"""`OracleDrafter`: drafts the target's own greedy continuation, accepted at a chosen rate (benchmarks only).

A benchmark builds its engine with one oracle as the drafter (and a fixed draft length), runs the prompt
greedily -- a sequence the oracle expects nothing of gets no drafts and decodes plainly -- and hands the
continuation to the oracle for the next sequences of that prompt (`expect`, with an acceptance profile
per sequence). At draft position i (1-based) the oracle proposes the right next token with probability
p_i of the profile, given that positions 1..i-1 were right; otherwise it proposes a wrong token there
(the reference token + 1) and fills the rest of the draft with reference tokens, so every pass verifies
the full draft length (at most the profile's length) and greedy verification accepts exactly the leading
right tokens.
The draws are deterministic per (seed, prompt, position), whatever the request id, so a rerun of the same
prompt proposes the same drafts as long as its committed tokens are the same.

Trees (`ranks`, for requests that ask for candidates): a per-rank profile [r_0, r_1, ...] applies at every
position: given that the positions before were among the candidates, the right token is the candidate of rank j
with probability r_j, and none of them with probability 1 - sum(r). Each position reports len(ranks) candidates
with the profile's values as their probabilities (wrong ones: the reference token + 1, + 2, ...); the draft's
chain is the rank-0 candidates. Candidates depend on the depth only (as per-position heads' do), so a tree's
accepted path follows the right candidates as deep as they are all present and in the tree.

The target agrees with the reference (`agree`): the benchmark's engine reads the target's argmax at every token row
of a sequence the oracle drafts for as the reference's token after that row's path. A pass's rounding (bf16 verify
rows round unlike a 1-row decode, and a tree's rows unlike a chain's) then cannot make the committed tokens leave
the reference, so every round drafts at the profile and the measured decode speed is that of the profile's
acceptance; the passes, the verification, the rollback and the commits run as they always do. `proposed` lists the
length of every draft it returned.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deltaspec.errors import DeltaspecError
from deltaspec.spec.drafter import Draft, DraftRequest


def expected_acceptance_length(profile: list[float]) -> float:
    """AL of a conditional acceptance profile: sum_j prod_{i<=j} p_i."""
    al, reach = 0.0, 1.0
    for p in profile:
        reach *= p
        al += reach
    return al


def profile_for_acceptance_length(al: float, k: int) -> list[float]:
    """A constant profile [p] * k with sum_{j=1..k} p^j == al (bisection); needs 0 <= al <= k."""
    if not 0 <= al <= k:
        raise DeltaspecError(f"An acceptance length of {al} is impossible with {k} draft tokens; use 0..{k}.")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_acceptance_length([mid] * k) < al else (lo, mid)
    return [round((lo + hi) / 2, 6)] * k


def parse_ranks(text: str) -> list[float]:
    """A per-rank profile like 0.6,0.2,0.1: probabilities of the candidates, most likely first, summing to <= 1."""
    ranks = parse_profile(text)
    if sum(ranks) > 1 + 1e-9 or ranks != sorted(ranks, reverse=True):
        raise DeltaspecError(f"A per-rank profile is non-increasing probabilities summing to at most 1; got {text!r}.")
    return ranks


def parse_profile(text: str) -> list[float]:
    try:
        profile = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise DeltaspecError(
            f"An acceptance profile is comma-separated probabilities like 0.9,0.8,0.7; got {text!r}."
        ) from None
    if not profile or any(not 0 <= p <= 1 for p in profile):
        raise DeltaspecError(f"An acceptance profile needs one to many probabilities in [0, 1]; got {text!r}.")
    return profile


@dataclass
class Expectation:
    """What the oracle drafts for one sequence."""

    prompt_len: int
    reference: list[int]  # the target's greedy continuation of the prompt
    profile: list[float]  # conditional acceptance per draft position; its length caps the draft
    ranks: list[float] | None = None  # per-rank profile for requests drafting for a tree (module docstring)


class OracleDrafter:
    name = "oracle"
    needs_hidden = False

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.seed = vocab_size, seed
        self.proposed: list[int] = []
        self.expected: dict[str, Expectation] = {}

    def expect(
        self,
        seq_id: str,
        prompt_len: int,
        continuation: list[int],
        profile: list[float],
        ranks: list[float] | None = None,
    ) -> None:
        """Draft for sequence `seq_id` (its prompt has `prompt_len` tokens, the target's greedy continuation is
        `continuation`) at the acceptance `profile`, or, for a tree, `len(profile)` positions deep at the per-rank
        profile `ranks`."""
        self.expected[seq_id] = Expectation(
            prompt_len, list(continuation), list(profile), None if ranks is None else list(ranks)
        )

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [self._draft(r) for r in requests]
        self.proposed.extend(len(d) for d in drafts)
        return drafts

    def _draft(self, request: DraftRequest) -> Draft:
        expected = self.expected.get(request.seq_id)
        if expected is None:
            return Draft([])
        ref = expected.reference
        start = len(request.token_ids) - expected.prompt_len
        if request.token_ids[expected.prompt_len :] != ref[:start]:
            raise DeltaspecError(
                f"Sequence {request.seq_id} left the oracle's reference: its engine must let the target agree "
                "with the oracle (`agree`)."
            )
        rng = random.Random(f"{self.seed}:{hash(tuple(request.token_ids[: expected.prompt_len]))}:{start}")
        if expected.ranks is not None and request.candidates:
            return self._tree_draft(expected, start, request.max_tokens, rng)
        tokens, right = [], True
        for i in range(min(request.max_tokens, len(expected.profile))):
            truth = ref[min(start + i, len(ref) - 1)]
            if right and rng.random() >= expected.profile[i]:
                right = False
                truth = (truth + 1) % self.vocab_size  # the first wrong token; later ones are never verified
            tokens.append(truth)
        return Draft(tokens)

    def _tree_draft(self, expected: Expectation, start: int, max_tokens: int, rng: random.Random) -> Draft:
        """Candidates per position at the per-rank profile (module docstring); the chain is their first ranks."""
        candidates, right = [], True
        for i in range(min(max_tokens, len(expected.profile))):
            truth = expected.reference[min(start + i, len(expected.reference) - 1)]
            wrong = [(truth + 1 + j) % self.vocab_size for j in range(len(expected.ranks))]
            if right:
                draw, rank = rng.random(), 0
                while rank < len(expected.ranks) and draw >= expected.ranks[rank]:
                    draw -= expected.ranks[rank]
                    rank += 1
                right = rank < len(expected.ranks)
                if right:
                    wrong[rank] = truth
            candidates.append(list(zip(wrong, expected.ranks)))
        return Draft([position[0][0] for position in candidates], candidates=candidates)

    def agree(self, seq_id: str, positions: list[int], argmax: list[int]) -> list[int]:
        """The target's argmax at a pass's token rows as the oracle's target gives it: at each row that predicts the
        token at position `positions[i]` within sequence `seq_id`'s reference, the reference's token; elsewhere
        (sequences the oracle drafts nothing for, positions past the reference) `argmax[i]` as the pass found it."""
        expected = self.expected.get(seq_id)
        if expected is None:
            return argmax
        ref, offset = expected.reference, expected.prompt_len
        return [ref[p - offset] if offset <= p < offset + len(ref) else t for p, t in zip(positions, argmax)]

    def observe(self, seq_id: str, first_position: int, hidden) -> None:
        """Not conditioned on the target's hidden states."""

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        pass  # stateless per round: the next propose compares the committed tokens with the reference

    def on_finish(self, seq_id: str) -> None:
        self.expected.pop(seq_id, None)

    def state_bytes(self) -> int:
        return sum(8 * len(e.reference) for e in self.expected.values())
