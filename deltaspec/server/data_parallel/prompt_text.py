"""The text a generating request's prefix affinity is judged on (`routing_text`): one string per request, written so
that a conversation's next turn starts with its previous turn's string, as its rendered prompt starts with the
previous rendered prompt. Tools come first (the chat template renders them into the system prompt), then each
message's role and text, in order; a completion's prompt is itself (token ids as their JSON list).

Only the endpoints that generate are routed on their prompt (`GENERATING_PATHS`); any other request goes to the
least-loaded replica. A body that is not a JSON object gives the empty text: the replica refuses it with its own
error.
"""

from __future__ import annotations

import json

GENERATING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/completion"})
SEPARATOR = "\x1e"  # between parts, so that no part's text runs into the next one's


def routing_text(path: str, body: object) -> str:
    """The routing text of a request to `path` with the decoded JSON `body`."""
    if not isinstance(body, dict):
        return ""
    parts = []
    if body.get("tools"):
        parts.append(_canonical(body["tools"]))
    if path == "/v1/responses":
        parts += [_text(body.get("instructions")), *_items(body.get("input"))]
    elif "messages" in body:
        parts += _items(body["messages"])
    else:
        parts.append(_text(body.get("prompt")))
    return SEPARATOR.join(part for part in parts if part)


def _items(items: object) -> list[str]:
    """A message list's (or a Responses input's) parts: each message's role, text and tool calls; any other item (a
    tool's output in a Responses input) as canonical JSON."""
    if not isinstance(items, list):
        return [_text(items)]
    return [_message(item) if isinstance(item, dict) and "role" in item else _text(item) for item in items]


def _message(message: dict) -> str:
    calls = message.get("tool_calls")
    return f"{_text(message['role'])}:{_text(message.get('content'))}{_canonical(calls) if calls else ''}"


def _text(value: object) -> str:
    """A content value as text: a string itself; content parts by their text (an image part as canonical JSON);
    anything else as canonical JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, dict) for part in value):
        return "".join(_part_text(part) for part in value)
    return _canonical(value)


def _part_text(part: dict) -> str:
    text = part.get("text")
    return text if isinstance(text, str) else _canonical(part)


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
