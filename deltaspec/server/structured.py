"""Request fields that constrain the output -> one `StructuredOutputsParams` (or None), and forced tool calls.

Accepted, on both endpoints: OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`; `strict: true` closes every object schema that does not say
otherwise, `additionalProperties: false`, as OpenAI's strict mode does), vLLM's `structured_outputs` object
(`json`, `json_object`, `regex`, `choice`, `grammar`) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one of them per request. On chat, `tool_choice: "required"` or a
named function makes the output one or more calls (a named choice, or `parallel_tool_calls: false`: exactly one,
after which the output ends; after each call of "required" the output may end) of the request's functions,
each valid against its parameters' schema, in the model's own call format: Qwen3's JSON blocks
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) or, when the chat template writes
`<function=` blocks, Qwen3.5's XML ones (string parameter values without `</`, others JSON); a reply that starts
in thinking may think first. Grammar text is llguidance's Lark dialect.
"""

from __future__ import annotations

import json
from typing import Any

from deltaspec.errors import DeltaspecError
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.params import StructuredOutputsParams
from deltaspec.server.errors import APIError
from deltaspec.server.protocol import SamplingFields

# The JSON of a call laid out as Qwen's templates show it (`{"name": "f", "arguments": {"x": 1}}`), on one line.
JSON_CALL_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not set it (strict mode)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs json_schema.schema (a JSON schema object).',
            param="response_format",
        )
    schema = fmt.json_schema.schema_
    return StructuredOutputsParams(json=closed(schema) if fmt.json_schema.strict else schema)


def _from_field(req: SamplingFields, field: str) -> StructuredOutputsParams | None:
    """The constraint request field `field` gives (None when it is unset)."""
    if field == "response_format":
        return _from_response_format(req)
    if field == "structured_outputs":
        return None if req.structured_outputs is None else StructuredOutputsParams(**req.structured_outputs.params())
    value = getattr(req, field)
    return None if value is None else StructuredOutputsParams(**{GUIDED[field]: value})


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from whichever one field gives it; a 400 for two of them or a malformed one."""
    found: dict[str, StructuredOutputsParams] = {}
    for field in ("response_format", "structured_outputs", *GUIDED):
        try:
            spec = _from_field(req, field)
        except DeltaspecError as exc:
            raise APIError(400, str(exc), param=field) from None
        if spec is not None:
            found[field] = spec
    if len(found) > 1:
        raise APIError(
            400,
            f"The request constrains its output twice ({', '.join(found)}); give one of them.",
            param=list(found)[1],
        )
    return next(iter(found.values()), None)


def _token(tokenizer: Tokenizer, text: str) -> str:
    """A Lark item for `text`: the special token when the tokenizer has it as one, else the literal text."""
    return text if tokenizer.token_to_id(text) is not None else json.dumps(text)


def rooted(schema: Any, name: str) -> Any:
    """A copy of `schema` whose local references (`#`, `#/...`) point into `#/$defs/<name>`: where the schema stands
    once it is moved under another schema's `$defs` (recursive parameter schemas keep working)."""
    if isinstance(schema, list):
        return [rooted(item, name) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rooted(value, name) for key, value in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = f"#/$defs/{name}{ref[1:]}"
    return out


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _json_call(index: int, tool: dict) -> dict:
    """The JSON schema of one `{"name": ..., "arguments": {...}}` call of `tool`, its arguments referring to the
    tool's parameters at `#/$defs/tool<index>` (`tool_call_grammar` puts them there)."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, "arguments": {"$ref": f"#/$defs/tool{index}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _xml_call(index: int, tool: dict, start: str, end: str) -> str:
    """Lark rules of one XML call of `tool` (rule `call{index}`): its parameters in declared order, the
    required ones present, strings as text without `</` (the closing tag in the same lexeme, so the text may hold
    newlines), the rest as JSON of their schema on one line."""
    function = tool["function"]
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    closing = json.dumps("\n</parameter>\n")
    defs = {"$defs": {"tool": rooted(parameters, "tool")}} if "$ref" in json.dumps(parameters) else {}
    rules, items = [], []
    for j, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
        if schema.get("type") == "string":
            value = r"/([^<]|<[^\/])*<\/parameter>\n/"
        else:
            schema = {**rooted(schema, "tool"), **defs, "x-guidance": JSON_CALL_LAYOUT}
            value = f"%json {json.dumps(schema)} {closing}"
        rules.append(f"p{index}_{j}: {json.dumps(f'<parameter={name}>' + chr(10))} {value}")
        items.append(f"p{index}_{j}" if name in required else f"p{index}_{j}?")
    head, tail = json.dumps(f"\n<function={function['name']}>\n"), json.dumps("</function>\n")
    rules.insert(0, f"call{index}: {start} {head} {' '.join(items)} {tail} {end}")
    return "\n".join(rules)


def tool_call_grammar(tokenizer: Tokenizer, tools: list[dict], one_call: bool, thinking: bool) -> str:
    """The Lark grammar of an output made of calls of `tools` (exactly one call when `one_call`)."""
    start, end = _token(tokenizer, "<tool_call>"), _token(tokenizer, "</tool_call>")
    xml = any("<function=" in template for template in tokenizer.chat_templates())
    if xml:
        rules = [_xml_call(i, tool, start, end) for i, tool in enumerate(tools)]
        call = "call: " + " | ".join(f"call{i}" for i in range(len(tools)))
    else:
        defs = {f"tool{i}": rooted(_parameters(tool), f"tool{i}") for i, tool in enumerate(tools)}
        calls = [_json_call(i, tool) for i, tool in enumerate(tools)]
        schema = {"anyOf": calls, "$defs": defs, "x-guidance": JSON_CALL_LAYOUT}
        rules, call = [], f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}'
    calls = "call" if one_call else 'call ("\\n" call)*'
    think = f"(/(.|\\n)*/ {_token(tokenizer, '</think>')} /\\n*/)? " if thinking else ""
    return "\n".join([f"start: {think}{calls}", call, *rules])


def forced_tool_calls(
    tokenizer: Tokenizer, tools: list[dict] | None, choice: Any, thinking: bool, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The constraint `tool_choice` "required" or a named function puts on a chat reply (None otherwise); one call
    only for a named function or without `parallel` calls."""
    if tools is None or choice in (None, "auto", "none"):
        return None
    one_call = choice != "required" or not parallel
    return StructuredOutputsParams(grammar=tool_call_grammar(tokenizer, tools, one_call, thinking))
