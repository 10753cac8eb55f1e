"""Tests for answer extraction and majority voting over n samples."""

from __future__ import annotations

import itertools

import pytest

from deltaspec.server.voting import Vote, extract_answer

# ---------------------------------------------------------------- extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # \boxed{...}: the last balanced one, nested braces kept
        ("So the area is $\\boxed{12}$.", "12"),
        ("\\boxed{1} first, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{a, b\\}}", "\\{a, b\\}"),
        ("\\boxed{7} and a cut-off \\boxed{\\frac{1", "7"),
        ("\\boxed{ 1,000 }", "1000"),
        ("The answer is 5, but \\boxed{6}", "6"),
        # markers: the last one, first non-empty line after it
        ("The answer is 42.\nThanks!", "42"),
        ("First answer is 1. Final answer is 2.", "2"),
        ("Reasoning...\n#### 1,234", "1234"),
        ("Answer: $3.50$", "3.5"),
        ("**Final Answer:** 17", "17"),
        ("the answer is: Paris", "Paris"),
        ("ANSWER:\n\n  B  \nmore", "B"),
        # otherwise the last non-empty line
        ("Some work.\n\nx = 9\n\n", "x = 9"),
        ("answer is\n", "answer is"),
        # normalisation
        ("+4", "4"),
        ("-0.0", "0"),
        ("-3.140", "-3.14"),
        ("0042", "42"),
        (".5", "0.5"),
        ("1,00", "1,00"),
        ("$12$.", "12"),
        ("v1.0", "v1.0"),
        # nothing to answer
        ("", None),
        ("  \n \n", None),
        ("\\boxed{}", None),
        ("...", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- Vote


def _vote(n: int, answers: list[str | None]) -> Vote:
    vote = Vote(n)
    for answer in answers:
        vote.add(answer)
    return vote


def test_counts_and_winner():
    vote = _vote(5, ["4", None, "5", "4"])
    assert vote.counts == {"4": 2, "5": 1}
    assert vote.winner == "4"
    assert vote.remaining == 1


def test_decided_early():
    assert _vote(5, ["7", "7", "7"]).decided
    assert not _vote(5, ["7", "7", "8"]).decided
    assert not _vote(5, ["7", "7"]).decided
    assert _vote(1, []).decided is False
    assert _vote(1, ["x"]).decided


def test_decided_when_the_runner_up_can_only_draw_level_later():
    vote = _vote(4, ["a", "a", "b"])  # b may reach 2 at the last sample, after a did
    assert vote.decided and vote.winner == "a"
    vote.add("b")
    assert vote.winner == "a"


def test_ties_go_to_the_answer_that_reached_the_count_first():
    assert _vote(4, ["a", "b", "b", "a"]).winner == "b"
    assert _vote(2, ["a", "b"]).winner == "a"


def test_all_none():
    vote = _vote(3, [None, None])
    assert (vote.winner, vote.counts, vote.decided) == (None, {}, False)
    vote.add(None)
    assert (vote.winner, vote.decided) == (None, True)


def test_rejects_bad_use():
    with pytest.raises(ValueError):
        Vote(0)
    vote = _vote(1, ["a"])
    with pytest.raises(ValueError):
        vote.add("a")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_decided_is_exact(n):
    """decided <=> every way of finishing the vote keeps the current winner."""
    alphabet = ["a", "b", "c", None]
    for k in range(n + 1):
        for prefix in itertools.product(alphabet, repeat=k):
            vote = _vote(n, list(prefix))
            finals = {_vote(n, [*prefix, *rest]).winner for rest in itertools.product(alphabet, repeat=n - k)}
            assert vote.decided == (finals == {vote.winner}), prefix
