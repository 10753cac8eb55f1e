"""Tests for splitting Qwen thinking from the answer, whole-text and streamed."""

from __future__ import annotations

import random

import pytest

from deltaspec.server.reasoning import ReasoningStream, split_reasoning

# ---------------------------------------------------------------- split_reasoning


@pytest.mark.parametrize(
    ("text", "started", "expected"),
    [
        # thinking on: output starts inside the think block
        ("Let me think.\n</think>\n\nThe answer is 4.", True, ("Let me think.", "The answer is 4.")),
        ("\nstep 1\n\nstep 2\n\n</think>\n\n4", True, ("step 1\n\nstep 2", "4")),
        # thinking off: all answer, verbatim
        ("Hello there.", False, (None, "Hello there.")),
        ("\nHi\n", False, (None, "\nHi\n")),
        ("a</think>b", False, (None, "a</think>b")),
        # the model writes <think> itself, with thinking on or off
        ("<think>\nhmm\n</think>\n\nok", False, ("hmm", "ok")),
        ("<think>\nhmm</think>ok", True, ("hmm", "ok")),
        # <think> anywhere but the start is text
        ("x <think> y", False, (None, "x <think> y")),
        ("x <think> y</think>z", True, ("x <think> y", "z")),
        # cut by max_tokens inside the think block: everything is reasoning
        ("long thought\n", True, ("long thought", "")),
        ("<think>\npartial", False, ("partial", "")),
        ("", True, ("", "")),
        ("", False, (None, "")),
        # only newlines are trimmed, and only around the split
        (" a \n</think>\n\n b \n", True, (" a ", " b \n")),
        ("a\n</think>\n", True, ("a", "")),
        # a second </think> belongs to the content
        ("a</think>b</think>c", True, ("a", "b</think>c")),
    ],
)
def test_split_reasoning(text, started, expected):
    assert split_reasoning(text, started) == expected


def test_xml_tool_call_inside_thinking_ends_reasoning():
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert split_reasoning(f"I need the weather.\n\n{call}", True) == ("I need the weather.", call)
    # whitespace between the tags is allowed, the tool call is kept whole
    assert split_reasoning("x<tool_call> \n<function=f>", True) == ("x", "<tool_call> \n<function=f>")


def test_tool_call_mention_without_function_stays_reasoning():
    text = "I should emit <tool_call> tags.\n</think>\n\nSure."
    assert split_reasoning(text, True) == ("I should emit <tool_call> tags.", "Sure.")
    assert split_reasoning("see <tool_call>{json}", True) == ("see <tool_call>{json}", "")


def test_earliest_end_marker_wins():
    assert split_reasoning("a</think>b<tool_call><function=f>", True) == ("a", "b<tool_call><function=f>")
    assert split_reasoning("a<tool_call><function=f></think>b", True) == ("a", "<tool_call><function=f></think>b")


# ---------------------------------------------------------------- ReasoningStream


def _stream(pieces: list[str], started: bool) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    stream = ReasoningStream(started)
    return [stream.feed(p) for p in pieces], stream.flush()


def test_stream_holds_back_a_split_end_tag():
    stream = ReasoningStream(True)
    assert stream.feed("abc</th") == ("abc", "")
    assert stream.feed("ink>\n\nx") == ("", "x")
    assert stream.feed(" y") == ("", " y")
    assert stream.flush() == ("", "")


def test_stream_holds_back_a_split_start_tag():
    stream = ReasoningStream(False)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nhmm") == ("hmm", "")
    assert stream.feed("</think>ok") == ("", "ok")


def test_stream_releases_text_that_is_not_a_tag():
    stream = ReasoningStream(False)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ere") == ("", "<there")
    stream = ReasoningStream(True)
    assert stream.feed("a <") == ("a ", "")
    assert stream.feed(" b") == ("< b", "")


def test_stream_emits_reasoning_without_delay():
    stream = ReasoningStream(True)
    assert stream.feed("Let me") == ("Let me", "")
    assert stream.feed(" think") == (" think", "")


def test_stream_holds_trailing_newlines_of_reasoning():
    stream = ReasoningStream(True)
    assert stream.feed("\nstep 1\n\n") == ("step 1", "")
    assert stream.feed("step 2\n") == ("\n\nstep 2", "")
    assert stream.feed("</think>\n") == ("", "")
    assert stream.feed("\nanswer") == ("", "answer")


def test_stream_waits_for_function_after_tool_call():
    stream = ReasoningStream(True)
    assert stream.feed("plan\n<tool_call>\n") == ("plan", "")
    assert stream.feed("<func") == ("", "")
    assert stream.feed("tion=f>") == ("", "<tool_call>\n<function=f>")
    stream = ReasoningStream(True)
    assert stream.feed("plan <tool_call>\n") == ("plan ", "")
    assert stream.feed("{") == ("<tool_call>\n{", "")


def test_stream_flush_of_truncated_thinking():
    assert _stream(["thinking\n", "\n"], True) == ([("thinking", ""), ("", "")], ("", ""))
    assert _stream(["x </thi"], True) == ([("x ", "")], ("</thi", ""))
    assert _stream(["<thi"], False) == ([("", "")], ("", "<thi"))
    assert _stream(["<thi"], True) == ([("", "")], ("<thi", ""))


_FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "<function=f>",
    "\n",
    "\n\n",
    " ",
    "<",
    "</",
    ">",
    "think",
    "abc",
    "x",
    "<tool_call>\n<function=get>",
    "</tool_call>",
    "{",
    "<thi",
]


@pytest.mark.parametrize("started", [True, False])
def test_stream_matches_split_for_random_texts_and_splits(started):
    rng = random.Random(1234)
    for _ in range(2000):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randrange(13)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(min(len(text), 6) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        deltas, last = _stream(pieces, started)
        reasoning, content = split_reasoning(text, started)
        assert "".join(d[0] for d in [*deltas, last]) == (reasoning or ""), (text, pieces)
        assert "".join(d[1] for d in [*deltas, last]) == content, (text, pieces)


def test_stream_char_by_char():
    text = "<think>\nThe user wants 2+2.\n</think>\n\n2 + 2 = **4**."
    deltas, last = _stream(list(text), False)
    assert "".join(d[0] for d in deltas) + last[0] == "The user wants 2+2."
    assert "".join(d[1] for d in deltas) + last[1] == "2 + 2 = **4**."
