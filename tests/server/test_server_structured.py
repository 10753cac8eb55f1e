"""Structured output through the server, driven by the real `openai` client on the embedded model with a drafter:
response_format (json_object, json_schema strict), vLLM's structured_outputs and guided_* fields on both
endpoints, streaming, and tool_choice "required" / a named function that always yields valid calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deltaspec.config.engine import EngineConfig
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.server.structured import tool_call_grammar
from tests.server.live import CTX, KEY, MODEL, NO_THINK, THINK, TOOLS, USER, Live, serving

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "langs": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "requests.jsonl"
    config = EngineConfig.from_flat(
        dtype="float32", device="cpu", max_num_seqs=4, max_model_len=CTX, speculative="draft+ngram", draft_tokens=4
    )
    with serving(log, config, api_key=KEY, served_model_name=MODEL, max_n=8) as server:
        yield server


def chat(live: Live, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("temperature", 0.0)
    extra = {k: kwargs.pop(k) for k in ("structured_outputs", "guided_choice", "chat_template_kwargs") if k in kwargs}
    return live.client().chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", USER), extra_body=extra or None, **kwargs
    )


@pytest.mark.parametrize("strict", [False, True])
def test_json_schema_response_format(live, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}}
    out = chat(live, response_format=fmt, n=3, temperature=0.8, seed=5)
    for choice in out.choices:
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        if strict:
            assert set(value) <= set(SCHEMA["properties"])  # strict closes the object


def test_json_object_and_streaming(live):
    stream = chat(live, response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_take_structured_outputs_and_guided_fields(live):
    client = live.client()
    regex = client.completions.create(
        model=MODEL,
        prompt="email = '",
        max_tokens=30,
        temperature=0.0,
        extra_body={"structured_outputs": {"regex": r"[a-z]{2,8}@[a-z]{2,8}\.com"}},
    )
    import re

    assert re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.com", regex.choices[0].text)
    choice = client.completions.create(
        model=MODEL,
        prompt="answer = ",
        max_tokens=5,
        temperature=1.0,
        n=4,
        seed=1,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert {c.text for c in choice.choices} <= {"yes", "no"}
    schema = client.completions.create(
        model=MODEL, prompt="person = ", max_tokens=120, temperature=0.0, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_choice_always_calls_a_declared_tool(live, thinking):
    out = chat(
        live,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        temperature=0.9,
        seed=2,
        chat_template_kwargs=(THINK if thinking else NO_THINK)["chat_template_kwargs"],
    )
    names = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in out.choices:
        calls = choice.message.tool_calls
        if thinking and choice.finish_reason == "length" and not calls:  # still thinking: the grammar lets it
            assert not choice.message.content and choice.message.reasoning_content
            continue
        assert calls, choice.message
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])
        assert choice.finish_reason in ("tool_calls", "length")  # "required" allows more calls after the first


def test_a_named_tool_choice_calls_exactly_that_tool(live):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = chat(live, tools=TOOLS, tool_choice=named, n=2, temperature=0.7, seed=3)
    for choice in out.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)


def test_xml_tool_call_grammar_accepts_qwen35_calls_only(live):
    """Qwen3.5's templates write `<function=` blocks: the forced-call grammar follows that format (checked on the
    embedded tokenizer with such a template)."""
    import llguidance

    base: Tokenizer = live.engine.tokenizer
    xml = Tokenizer(
        base._backend,
        source="test",
        special_tokens=base._special_tokens,
        eos_token_ids=base.eos_token_ids,
        chat_templates={"default": "{{ '<tool_call>\\n<function=' }}"},
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
    ]
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(xml, tools, one_call=False, thinking=False))
    lltok = live.engine.structured._llg_tokenizer()
    city, days = "<parameter=city>\nParis\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n"
    good = f"<tool_call>\n<function=f>\n{city}{days}</function>\n</tool_call>"
    bad = f"<tool_call>\n<function=f>\n{days}</function>\n</tool_call>"  # the required city is missing
    for text, ok in ((good, True), (bad, False)):
        ids = xml.encode(text)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok


# a recursive parameter schema: legal JSON Schema, accepted in response_format, so accepted in tools too
TREE = {
    "type": "object",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["v"],
        }
    },  # fmt: skip
    "properties": {"root": {"$ref": "#/$defs/node"}},
    "required": ["root"],
}


@pytest.mark.parametrize("xml", [False, True])
def test_recursive_parameter_schemas_constrain_tool_calls(live, xml):
    """Each tool's parameters sit under the grammar's `$defs`, their `#/...` references moved with them, in both
    call formats: a nested call is accepted, one missing a required field deep inside refused."""
    import llguidance

    base: Tokenizer = live.engine.tokenizer
    template = "{{ '<tool_call>\\n<function=' }}" if xml else "{{ '<tool_call>' }}"
    tokenizer = Tokenizer(
        base._backend,
        source="test",
        special_tokens=base._special_tokens,
        eos_token_ids=base.eos_token_ids,
        chat_templates={"default": template},
    )
    tools = [{"type": "function", "function": {"name": "walk", "parameters": TREE}}]
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(tokenizer, tools, one_call=True, thinking=False))
    if xml:
        call = "<tool_call>\n<function=walk>\n<parameter=root>\n{root}\n</parameter>\n</function>\n</tool_call>"
    else:
        call = '<tool_call>\n{{"name": "walk", "arguments": {{"root": {root}}}}}\n</tool_call>'
    lltok = live.engine.structured._llg_tokenizer()
    for root, ok in (('{"v": 1, "kids": [{"v": 2, "kids": []}]}', True), ('{"v": 1, "kids": [{"kids": []}]}', False)):
        ids = tokenizer.encode(call.format(root=root))
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok, (xml, root)
