"""Compare two engines' greedy outputs where rounding may flip a near tie."""

from __future__ import annotations

import pytest


def assert_follows(got, want, tolerance: float) -> None:
    """`got` and `want` (`CompletionOutput`s of greedy requests with `logprobs` >= 2): the chosen tokens' logprobs
    within `tolerance` and the tokens equal, up to the first step where they part on a near tie — `got`'s pick
    within `tolerance` of `want`'s best, which rounding can flip — after which the continuations differ by design."""
    for mine_token, mine, their_token, theirs in zip(got.token_ids, got.logprobs, want.token_ids, want.logprobs):
        assert their_token in mine, f"the reference's pick {their_token} is not among the other's top logprobs"
        assert mine[their_token].logprob == pytest.approx(theirs[their_token].logprob, abs=tolerance)
        if mine_token != their_token:
            assert mine_token in theirs, f"the pick {mine_token} is not among the reference's top logprobs"
            assert theirs[their_token].logprob - theirs[mine_token].logprob <= tolerance
            return
