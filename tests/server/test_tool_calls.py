"""Tests for turning Qwen <tool_call> blocks (JSON and XML) into OpenAI tool calls."""

from __future__ import annotations

import json
import random
import re

import pytest

from deltaspec.server.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "i": {"type": "integer"},
                    "n": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "ns": {"type": ["string", "null"]},
                    "ni": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
                    "u": {"description": "no type"},
                },
            },
        },
    }
]


def _args(text: str, tools=TOOLS) -> dict:
    content, calls = parse_tool_calls(text, tools)
    assert len(calls) == 1, (content, calls)
    return json.loads(calls[0].arguments)


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# ---------------------------------------------------------------- parse_tool_calls


@pytest.mark.parametrize("block", [JSON_CALL, XML_CALL])
def test_both_formats(block):
    content, calls = parse_tool_calls(block)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_ids_come_from_the_given_rng():
    text = JSON_CALL + XML_CALL
    _, first = parse_tool_calls(text, rng=random.Random(7))
    _, again = parse_tool_calls(text, rng=random.Random(7))
    _, other = parse_tool_calls(text, rng=random.Random(8))
    assert [c.id for c in first] == [c.id for c in again]
    assert first[0].id != first[1].id
    assert [c.id for c in first] != [c.id for c in other]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in first)


def test_content_around_calls_is_kept_and_stripped():
    text = f"  Let me check.\n{JSON_CALL}\nand\n{XML_CALL}\n  Done. \n"
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n\nand\n\n  Done."
    assert len(calls) == 2


def test_no_calls_gives_stripped_text():
    assert parse_tool_calls("\n Just an answer. \n") == ("Just an answer.", [])


def test_to_dict_is_the_openai_shape():
    call = ToolCall(id="call_1", name="f", arguments="{}")
    assert call.to_dict() == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_json_format_details():
    assert _args('<tool_call>{"name": "f"}</tool_call>') == {}
    assert _args('<tool_call>{"name": "f", "arguments": {"x": [1, {"y": null}]}}</tool_call>') == {
        "x": [1, {"y": None}]
    }
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert calls[0].arguments == '{"city": "Zürich"}'


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"s": "123"}, {"s": "123"}),
        ({"i": "42"}, {"i": 42}),
        ({"i": "4.5"}, {"i": "4.5"}),
        ({"i": "abc"}, {"i": "abc"}),
        ({"n": "3.5"}, {"n": 3.5}),
        ({"n": "-2"}, {"n": -2}),
        ({"n": "NaN"}, {"n": "NaN"}),
        ({"n": "true"}, {"n": "true"}),
        ({"b": "true"}, {"b": True}),
        ({"b": "False"}, {"b": False}),
        ({"b": "yes"}, {"b": "yes"}),
        ({"o": '{"k": [1, 2]}'}, {"o": {"k": [1, 2]}}),
        ({"o": "{'k': 'v'}"}, {"o": {"k": "v"}}),
        ({"o": "[1]"}, {"o": "[1]"}),
        ({"o": "{not json"}, {"o": "{not json"}),
        ({"a": '["x", "y"]'}, {"a": ["x", "y"]}),
        ({"a": "{1, 2}"}, {"a": "{1, 2}"}),
        ({"a": "(1, 2)"}, {"a": "(1, 2)"}),
        ({"i": "null"}, {"i": None}),
        ({"o": "None"}, {"o": None}),
        ({"s": "null"}, {"s": "null"}),
        ({"ns": "null"}, {"ns": None}),
        ({"ns": "text"}, {"ns": "text"}),
        ({"ni": "7"}, {"ni": 7}),
        ({"ni": "None"}, {"ni": None}),
        ({"u": "7"}, {"u": "7"}),
        ({"unknown": "7"}, {"unknown": "7"}),
    ],
)
def test_xml_values_follow_the_schema(params, expected):
    assert _args(_xml("f", **params)) == expected


def test_xml_values_are_strings_without_a_schema():
    assert _args(_xml("f", i="42", b="true"), tools=None) == {"i": "42", "b": "true"}
    assert _args(_xml("other", i="42"), tools=TOOLS) == {"i": "42"}


def test_xml_value_keeps_inner_whitespace():
    block = "<tool_call><function=f><parameter=s>\n\n  two lines\nof code\n\n</parameter></function></tool_call>"
    assert _args(block) == {"s": "\n  two lines\nof code\n"}
    assert _args("<tool_call><function=f><parameter=s>x</parameter></function></tool_call>") == {"s": "x"}


def test_xml_tolerates_missing_closing_tags():
    block = "<tool_call>\n<function=f>\n<parameter=i>\n1\n<parameter=s>\nhi\n</tool_call>"
    assert _args(block) == {"i": 1, "s": "hi"}
    assert _args("<tool_call><function=f></tool_call>") == {}


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # bad JSON
        '<tool_call>["f"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "two words"}</tool_call>',  # not a name
        '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',  # overflows to inf
        "<tool_call>just some text</tool_call>",  # neither format
        "<tool_call></tool_call>",
        "<tool_call><function=f</tool_call>",  # unterminated name
        "<tool_call><function={{ name }}></function></tool_call>",  # template leftovers
        "<tool_call><function=f>junk<parameter=s>x</parameter></function></tool_call>",
        "<tool_call><function=f><parameter=s>x</parameter></function>junk</tool_call>",
        "<tool_call><function=f><parameter=>x</parameter></function></tool_call>",
    ],
)
def test_malformed_blocks_stay_in_content(block):
    text = f"Before.\n{block}\n{JSON_CALL}"
    content, calls = parse_tool_calls(text)
    assert content == f"Before.\n{block}"
    assert [c.name for c in calls] == ["get_weather"]


def test_unclosed_block_at_the_end_is_content():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "argu'
    assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls(f"{JSON_CALL}\n<tool_call>\n<function=f>")
    assert content == "<tool_call>\n<function=f>" and len(calls) == 1


# ---------------------------------------------------------------- ToolCallStream


def _run(pieces: list[str], tools=None, seed=0) -> tuple[str, list[dict], ToolCallStream]:
    stream = ToolCallStream(tools, rng=random.Random(seed))
    content, calls = [], []
    for piece in [*pieces, None]:
        text, deltas = stream.flush() if piece is None else stream.feed(piece)
        content.append(text)
        calls.extend(deltas)
    return "".join(content), calls, stream


def test_stream_emits_each_call_once_complete():
    stream = ToolCallStream(rng=random.Random(3))
    assert stream.feed("Let me look. <tool") == ("Let me look.", [])
    assert stream.feed('_call>\n{"name": "get_weather", ') == ("", [])
    assert not stream.has_calls
    text, calls = stream.feed('"arguments": {"city": "Paris"}}\n</tool_call>\n')
    _, expected = parse_tool_calls(JSON_CALL, rng=random.Random(3))
    assert text == ""
    assert calls == [{"index": 0, **expected[0].to_dict()}]
    assert stream.has_calls
    text, calls = stream.feed(XML_CALL)
    assert text == "" and [(c["index"], c["function"]["name"]) for c in calls] == [(1, "get_weather")]
    assert stream.flush() == ("", [])


def test_stream_releases_text_that_is_not_a_tag():
    stream = ToolCallStream()
    assert stream.feed("a <tool") == ("a", [])
    assert stream.feed("s> b") == (" <tools> b", [])


def test_stream_emits_content_without_delay():
    stream = ToolCallStream()
    assert stream.feed("Hello") == ("Hello", [])
    assert stream.feed(" world") == (" world", [])
    assert stream.feed("\n") == ("", [])
    assert stream.feed("!") == ("\n!", [])


def test_stream_flush_turns_an_unfinished_block_into_content():
    text, calls, stream = _run(["Sure.\n", "<tool_call>\n", '{"name": "f"'])
    assert (text, calls, stream.has_calls) == ('Sure.\n<tool_call>\n{"name": "f"', [], False)


def test_stream_malformed_block_is_content():
    text, calls, _ = _run(["x ", "<tool_call>oops</tool_call>", " y"])
    assert (text, calls) == ("x <tool_call>oops</tool_call> y", [])


_BLOCKS = [
    JSON_CALL,
    XML_CALL,
    _xml("f", i="3", b="True", s="a b"),
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    "<tool_call>bad</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "<",
    "_call>",
    "text",
    " ",
    "\n",
    "\n\n",
    "Let me check.",
    "{",
    "}",
]


def test_stream_matches_parse_for_random_texts_and_splits():
    rng = random.Random(99)
    for _ in range(1500):
        text = "".join(rng.choice(_BLOCKS) for _ in range(rng.randrange(9)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(min(len(text), 8) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        seed = rng.randrange(1000)
        content, deltas, stream = _run(pieces, TOOLS, seed)
        expected_content, expected_calls = parse_tool_calls(text, TOOLS, random.Random(seed))
        assert content == expected_content, (text, pieces)
        assert deltas == [{"index": i, **c.to_dict()} for i, c in enumerate(expected_calls)], (text, pieces)
        assert stream.has_calls == bool(expected_calls)
