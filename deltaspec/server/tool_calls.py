"""Qwen `<tool_call>` blocks in generated text -> OpenAI `tool_calls`, whole-text and streamed.

Owns both block formats Qwen models emit:

- JSON (Qwen3, Qwen3-Next; vLLM's `hermes` parser):
  `<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>`
- XML (Qwen3.5, Qwen3-Coder; vLLM's `qwen3_coder` parser):
  `<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>`.
  A parameter value is raw text minus one leading and one trailing newline. It stays a string
  unless the tool's JSON schema types it: integer / number / boolean / object / array values are
  parsed as JSON (booleans case-insensitively, so Python's `True` works; objects and arrays
  fall back to Python literals like `{'a': 1}`), and `null` / `None` becomes null for non-string
  or nullable parameters. A value that does not parse as its type stays a string.

A block whose body is neither format, whose JSON is invalid, or whose function name is not a plain
identifier-like name, is left in the content as text and yields no call; so is an unclosed block
at the end (generation cut off). Content is everything outside the parsed blocks, stripped.
Unlike vLLM, which keeps only the text before the first call, text between and after calls is
kept too.

A `CallLimit` says which calls one reply may make (`parallel_tool_calls: false`: one; a forced reply: none that
repeats an earlier call of the reply): the reply ends where the first call past the limit begins, and that call
and everything after it are dropped (`cut_at_limit`, and `ToolCallStream.ended` while streaming).
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A missing </parameter> ends the value at the next <parameter= or at the end of the body.
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_BAD_NAME_CHARS = frozenset("{}<>\"' \t\r\n")
_NULLS = ("null", "none")
_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


@dataclass(frozen=True)
class CallLimit:
    """Which tool calls one reply may make: at most `most` (None: any number) and, when `distinct`, none that
    repeats an earlier call of the reply (same function, same arguments: a forced reply's loop)."""

    most: int | None = None
    distinct: bool = False

    @property
    def limits(self) -> bool:
        return self.most is not None or self.distinct

    def allows(self, earlier: list[tuple[str, str]], call: tuple[str, str]) -> bool:
        """Whether `call` (name, arguments) may follow the reply's `earlier` calls."""
        if self.most is not None and len(earlier) >= self.most:
            return False
        return not (self.distinct and call in earlier)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text, as OpenAI returns it

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry of a chat completion message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _new_call_id(rng: random.Random) -> str:
    return f"call_{rng.getrandbits(96):024x}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not _BAD_NAME_CHARS.intersection(name)


def _properties(tools: list[dict] | None, name: str) -> dict[str, Any]:
    """The JSON-schema `properties` of the OpenAI-style tool called `name` ({} if unknown)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def _schema_types(schema: dict[str, Any]) -> list[str]:
    """The types a parameter schema allows: `type` (a name or a list), else `anyOf`/`oneOf`."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    options = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(options, list):
        return [o["type"] for o in options if isinstance(o, dict) and isinstance(o.get("type"), str)]
    return []


def _convert(value: str, schema: Any) -> Any:
    """An XML parameter's raw text as the JSON value its schema asks for (else the text)."""
    if not isinstance(schema, dict):
        return value
    types = _schema_types(schema)
    kind = next((t for t in types if t != "null"), "string")
    text = value.strip()
    if text.lower() in _NULLS and ("null" in types or kind != "string"):
        return None
    check = _TYPE_CHECKS.get(kind)
    if check is None:
        return value
    candidate = text.lower() if kind == "boolean" else text
    try:
        parsed = json.loads(candidate, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        if kind not in ("object", "array"):
            return value
        try:
            parsed = ast.literal_eval(candidate)
            json.dumps(parsed, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return value
    return parsed if check(parsed) else value


def _parse_json(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments", {})
    if not _valid_name(name) or not isinstance(arguments, dict):
        return None
    return name, arguments


def _parse_xml(body: str, tools: list[dict] | None) -> tuple[str, dict[str, Any]] | None:
    name_end = body.find(">")
    name = body[len(_FUNCTION_OPEN) : name_end]
    if name_end < 0 or not _valid_name(name):
        return None
    params = body[name_end + 1 :]
    if params.endswith(_FUNCTION_CLOSE):
        params = params[: -len(_FUNCTION_CLOSE)]
    properties = _properties(tools, name)
    arguments: dict[str, Any] = {}
    pos = 0
    for match in _PARAMETER.finditer(params):
        param = match.group(1)
        if params[pos : match.start()].strip() or not _valid_name(param):
            return None
        value = match.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[param] = _convert(value, properties.get(param))
        pos = match.end()
    if params[pos:].strip():
        return None
    return name, arguments


def _parse_block(inner: str, tools: list[dict] | None) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of the text between <tool_call> and </tool_call>."""
    body = inner.strip()
    if body.startswith("{"):
        parsed = _parse_json(body)
    elif body.startswith(_FUNCTION_OPEN):
        parsed = _parse_xml(body, tools)
    else:
        return None
    if parsed is None:
        return None
    try:
        return parsed[0], json.dumps(parsed[1], ensure_ascii=False, allow_nan=False)
    except ValueError:  # an overflowing number such as 1e999 parsed to inf
        return None


def parse_tool_calls(
    text: str, tools: list[dict] | None = None, rng: random.Random | None = None
) -> tuple[str, list[ToolCall]]:
    """(content without the parsed tool-call blocks, stripped; the calls in order).

    `tools` is the request's OpenAI `tools` list (types XML parameters); `rng` draws call ids.
    """
    rng = rng or random.Random()
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        parsed = _parse_block(match.group(1), tools)
        if parsed is None:
            continue
        pieces.append(text[pos : match.start()])
        pos = match.end()
        calls.append(ToolCall(_new_call_id(rng), *parsed))
    pieces.append(text[pos:])
    return "".join(pieces).strip(), calls


def cut_at_limit(text: str, tools: list[dict] | None, limit: CallLimit) -> str | None:
    """`text` up to the start of its first call block past `limit`, or None when every call is allowed."""
    earlier: list[tuple[str, str]] = []
    for match in _BLOCK.finditer(text):
        parsed = _parse_block(match.group(1), tools)
        if parsed is None:
            continue
        if not limit.allows(earlier, parsed):
            return text[: match.start()]
        earlier.append(parsed)
    return None


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolCallStream:
    """Incremental `parse_tool_calls`: feed content deltas, get (content_delta, tool_call_deltas).

    Each call is emitted as one complete OpenAI streaming delta, `{"index", "id", "type",
    "function": {"name", "arguments"}}`, once its `</tool_call>` arrives. Held back meanwhile:
    a possible start of `<tool_call>`, an open block, and trailing whitespace (the content is
    stripped as a whole, so whitespace is emitted only once more text follows it).
    """

    def __init__(
        self, tools: list[dict] | None = None, rng: random.Random | None = None, limit: CallLimit = CallLimit()
    ) -> None:
        self._tools = tools
        self._rng = rng or random.Random()
        self._limit = limit
        self._calls: list[tuple[str, str]] = []
        self.ended = False  # a call past the limit arrived: the reply ends before it
        self._buf = ""
        self._in_block = False
        self._content_started = False
        self._held_space = ""
        self._num_calls = 0

    @property
    def has_calls(self) -> bool:
        """Whether any tool call has been emitted (finish_reason becomes "tool_calls")."""
        return self._num_calls > 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Add the next piece of content; return what can be emitted now (nothing once `ended`)."""
        if self.ended:
            return "", []
        self._buf += delta
        return self._drain(final=False)

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """End of generation: an unfinished block or held text becomes content."""
        if self.ended:
            return "", []
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    if final:
                        content.append(TOOL_CALL_START + self._buf)
                        self._buf = ""
                    break
                inner, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END) :]
                self._in_block = False
                parsed = _parse_block(inner, self._tools)
                if parsed is not None and not self._limit.allows(self._calls, parsed):
                    self.ended, self._buf = True, ""
                    return self._strip("".join(content), final=True), calls
                if parsed is None:
                    content.append(TOOL_CALL_START + inner + TOOL_CALL_END)
                else:
                    self._calls.append(parsed)
                    call = ToolCall(_new_call_id(self._rng), *parsed)
                    calls.append({"index": self._num_calls, **call.to_dict()})
                    self._num_calls += 1
            else:
                start = self._buf.find(TOOL_CALL_START)
                if start >= 0:
                    content.append(self._buf[:start])
                    self._buf = self._buf[start + len(TOOL_CALL_START) :]
                    self._in_block = True
                    continue
                cut = len(self._buf) - (0 if final else _partial_tag_len(self._buf, TOOL_CALL_START))
                content.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
        return self._strip("".join(content), final), calls

    def _strip(self, text: str, final: bool) -> str:
        """Streamed `strip()`: drop leading whitespace, hold trailing whitespace until text follows."""
        if not self._content_started:
            text = text.lstrip()
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = "" if final else text[len(body) :]
        if body:
            self._content_started = True
        return body
