"""Majority voting over n samples (the server's `"vote": true` extension, on both endpoints).

Owns what "the answer" of a completion is (`extract_answer`), the tally (`Vote`), including when
it is decided so the server can stop sampling early, and a request's vote over its samples as they
finish (`SampleVote`), whatever the endpoint's choice type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

from deltaspec.server.protocol import VoteInfo
from deltaspec.server.samples import Sample

_BOXED = "\\boxed{"
_MARKER = re.compile(r"answer is|answer:|####", re.IGNORECASE)
_NUMBER = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)?(?:\.(\d+))?")
Choice = TypeVar("Choice")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces balance (a cut-off one is skipped)."""
    start = text.rfind(_BOXED)
    while start >= 0:
        depth = 0
        for i in range(start + len(_BOXED) - 1, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : i]
        start = text.rfind(_BOXED, 0, start)
    return None


def _after_last_marker(text: str) -> str | None:
    """First non-empty line after the last "answer is" / "Answer:" / "####", if any."""
    markers = list(_MARKER.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end() :].lstrip(" \t:")
    return next((line for line in rest.splitlines() if line.strip()), None)


def _normalise(answer: str) -> str:
    """Drop surrounding `$`, `*` (markdown bold), spaces and trailing periods; canonical numbers."""
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().strip("$*").rstrip(".")
    number = _NUMBER.fullmatch(answer)
    if number is None or not (number[2] or number[3]):
        return answer
    sign, whole, fraction = number.groups()
    whole = (whole or "").replace(",", "").lstrip("0") or "0"
    fraction = (fraction or "").rstrip("0")
    canonical = whole + ("." + fraction if fraction else "")
    return "-" + canonical if sign == "-" and canonical != "0" else canonical


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, normalised for comparison; None if there is none.

    Taken from the last balanced `\\boxed{...}`, else the first non-empty line after the last
    answer marker, else the last non-empty line.
    """
    found = _last_boxed(text)
    if found is None:
        found = _after_last_marker(text)
    if found is None:
        found = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return _normalise(found) or None


class Vote:
    """Tally of the answers of n samples; the winner has the most votes.

    Ties go to the answer that reached the tied count first. Because of that rule the tally is
    decided as soon as the leader's count is at least the runner-up's plus the samples still to
    come: even if every remaining sample goes to the runner-up, it only draws level, later.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a vote needs at least one sample, got n={n}")
        self._n = n
        self._added = 0
        self._counts: dict[str, int] = {}
        self._reached_at: dict[str, int] = {}  # answer -> sample number at which it got its count

    def add(self, answer: str | None) -> None:
        """Count one sample's answer; None (no answer found) uses up a sample without a vote."""
        if self._added == self._n:
            raise ValueError(f"all {self._n} samples have already been added")
        self._added += 1
        if answer is not None:
            self._counts[answer] = self._counts.get(answer, 0) + 1
            self._reached_at[answer] = self._added

    @property
    def counts(self) -> dict[str, int]:
        """Votes per answer, in order of first appearance."""
        return dict(self._counts)

    @property
    def remaining(self) -> int:
        """Samples not yet added."""
        return self._n - self._added

    def _ranking(self) -> list[str]:
        return sorted(self._counts, key=lambda a: (-self._counts[a], self._reached_at[a]))

    @property
    def winner(self) -> str | None:
        """The answer with the most votes so far (None if no sample had an answer)."""
        ranking = self._ranking()
        return ranking[0] if ranking else None

    @property
    def decided(self) -> bool:
        """Whether no outcome of the remaining samples can change the winner."""
        if self.remaining == 0:
            return True
        ranking = self._ranking()
        if not ranking:
            return False
        runner_up = self._counts[ranking[1]] if len(ranking) > 1 else 0
        return self._counts[ranking[0]] >= runner_up + self.remaining


class SampleVote(Generic[Choice]):
    """The `vote` of one request as its samples finish: each finished sample's choice and answer are kept, and
    `stop` is called once the tally is decided (the server then aborts the samples still running).

    `choice_of` shapes a finished sample into the endpoint's choice (index 0) and the text its answer is read from.
    """

    def __init__(
        self,
        samples: list[Sample],
        choice_of: Callable[[Sample], tuple[Choice, str]],
        stop: Callable[[], None],
    ) -> None:
        self.samples, self.choice_of, self.stop = samples, choice_of, stop
        self.vote = Vote(len(samples))
        self.finished: list[tuple[Choice, str | None]] = []  # in finishing order

    def on_finished(self, sample: Sample) -> None:
        if sample.finish_reason in ("abort", "error"):
            return
        choice, text = self.choice_of(sample)
        answer = extract_answer(text)
        self.finished.append((choice, answer))
        self.vote.add(answer)
        if self.vote.decided:
            self.stop()

    def result(self) -> tuple[Choice, VoteInfo]:
        """The first finished choice with the winning answer (the first sample's when none finished) and the tally."""
        winner = self.vote.winner
        choice = next((c for c, answer in self.finished if winner is None or answer == winner), None)
        if choice is None:
            choice = self.choice_of(self.samples[0])[0]
        aborted = sum(s.finish_reason == "abort" for s in self.samples)
        return choice, VoteInfo(
            winner=winner, counts=self.vote.counts, samples_finished=len(self.finished), samples_aborted=aborted
        )
