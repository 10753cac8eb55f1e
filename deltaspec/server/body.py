"""Reading a request body as a JSON object, with the checks a hostile body needs before anything else sees it.

Owns, in order: the Content-Type (JSON, else 415: as vLLM does, a body must say it is JSON, which also keeps
web pages from posting to the server: `browsers.py`), the size limit (413, from Content-Length
when the client sends one and while reading otherwise), and, in `parse_json` (which the app runs on a
worker thread), what Python's `json` accepts but the server must not: `NaN` and `Infinity`, numbers
that overflow to infinity or underflow to zero, nesting deeper than `MAX_DEPTH` (a body nested
100,000 deep would overflow the recursion limit of the parser or of what reads it later), and lone
UTF-16 surrogates (`"\\ud800"` decodes to text that cannot be encoded or tokenized). Each is an
`APIError` of one sentence.
"""

from __future__ import annotations

import json
import math

from starlette.requests import ClientDisconnect, Request

from deltaspec.server.errors import APIError, shown

MAX_DEPTH = 64


class _BadNumber(ValueError):
    """A number literal the server refuses (raised from the parser's hooks, turned into a 400)."""


def check_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (`application/json`, any parameters, or a `+json` type)."""
    declared = request.headers.get("content-type")
    if declared is None:
        raise APIError(
            415, "The request has no Content-Type header; send the JSON body with 'Content-Type: application/json'."
        )
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(
            415,
            f"The request body is sent as {shown(declared)}, but this endpoint reads JSON; "
            "send it with 'Content-Type: application/json'.",
        )


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes (--max-request-bytes); "
        "send a shorter prompt or fewer messages.",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or a 413 as soon as it is known to exceed `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "The client closed the connection before it sent the whole request body.") from None
    return b"".join(chunks)


def _constant(name: str) -> float:
    raise _BadNumber(f"The request body contains {name}, which JSON does not allow; send a finite number.")


def _float(literal: str) -> float:
    value = float(literal)
    number = literal if len(literal) <= 40 else literal[:37] + "..."
    if math.isinf(value):
        raise _BadNumber(f"The number {number} in the request body is too large for a float; send a finite number.")
    if value == 0 and any(digit in "123456789" for digit in literal.lower().partition("e")[0]):
        raise _BadNumber(
            f"The number {number} in the request body is too small for a float and would be read as 0; "
            "send 0 or a larger number."
        )
    return value


def _name(path: tuple) -> str:
    """`('messages', 0, 'content')` -> `messages[0].content`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + _key(part)
    return out


def _key(key: str) -> str:
    """An object key as a path step: as it is when plain, else its escaped repr."""
    return key if key.isascii() and key.isprintable() and len(key) <= 40 else shown(key, 40)


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_error(path: tuple) -> APIError:
    where = f"'{_name(path)}'" if path else "the request body"
    return APIError(
        400,
        f"{where[0].upper()}{where[1:]} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
        "which is not valid Unicode; send well-formed text.",
        param=_name(path) or None,
    )


def check_tree(data: object) -> None:
    """400 for nesting deeper than MAX_DEPTH or a lone surrogate in any key or string (iterative: no recursion)."""
    stack: list[tuple[object, int, tuple]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                raise _surrogate_error(path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            field = _name(path[:1])
            raise APIError(
                400,
                f"The request body nests arrays and objects more than {MAX_DEPTH} deep in '{field}'; "
                "send a flatter value.",
                param=field,
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _has_surrogate(key):
                raise _surrogate_error((*path, key))
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, (*path, key)))


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, checked by `check_tree`; every problem is a 400 of one sentence."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON.") from None
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_float)
    except _BadNumber as exc:
        raise APIError(400, str(exc)) from None
    except RecursionError:
        raise APIError(
            400, f"The request body nests arrays and objects more than {MAX_DEPTH} deep; send a flatter body."
        ) from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON ({exc.msg} at character {exc.pos}).") from None
    except ValueError:  # an integer literal longer than Python's int_max_str_digits
        raise APIError(400, "The request body contains a number too long to read; send shorter numbers.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    check_tree(data)
    return data
