"""OpenAI-style error responses: `APIError`, its JSON body, and readable pydantic validation messages.

Every 4xx/5xx the server sends has the body `{"error": {"message", "type", "param", "code"}}` with
a message of one sentence; this module is the one place that shapes it. Text that came from the
client may not be valid Unicode (a lone surrogate such as `\\ud800` decodes from JSON but cannot be
encoded), so messages and params are escaped before they are sent, and a `redact` function given by
the app replaces what a client must not see (the model's absolute path).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deltaspec.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 500: "server_error"}
# What a union-typed field accepts, for messages that name the whole field rather than one arm of the union.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def printable(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes, so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: object, limit: int = 60) -> str:
    """A client's value for a message: its repr, escaped, cut to about `limit` characters."""
    text = printable(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class APIError(Exception):
    """A request the server answers with an error status and a one-sentence message."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, redact: Callable[[str], str] = str) -> dict:
        info = ErrorInfo(
            message=printable(redact(self.message)),
            type=_TYPES.get(self.status, "invalid_request_error"),
            param=printable(self.param) if self.param is not None else None,
            code=self.code if self.code is not None else self.status,
        )
        return ErrorResponse(error=info).model_dump()

    def response(self, redact: Callable[[str], str] = str) -> JSONResponse:
        return JSONResponse(self.body(redact), status_code=self.status, headers=self.headers)


def _field_path(loc: tuple) -> tuple[str, bool]:
    """`('messages', 0, 'content', 'str')` -> (`messages[0].content`, True): the path up to pydantic's union tags,
    and whether a union tag cut it."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path += ("." if path else "") + part
        else:
            return path, True
    return path, False


def _is_type_mismatch(error: dict) -> bool:
    return error["type"].endswith("_type") or error["type"] == "literal_error"


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body, in one sentence.

    A union-typed field fails once per arm of the union; a broken rule of the arm whose type fitted (too many
    stop strings) is reported before type mismatches, and a field that fitted no arm says what it accepts.
    """
    errors = exc.errors()
    first = errors[0]
    path, in_union = _field_path(tuple(first["loc"]))
    if first["type"] == "missing":
        return APIError(400, f"The request is missing the required field '{path}'.", param=path)
    if not path:
        return APIError(400, "The request body must be a JSON object.")
    if in_union:
        same_field = [e for e in errors if _field_path(tuple(e["loc"]))[0] == path]
        first = next((e for e in same_field if not _is_type_mismatch(e)), first)
        field = path.rsplit(".", 1)[-1]
        if _is_type_mismatch(first) and field in _UNION_FIELDS:
            return APIError(400, f"Invalid value for '{path}': it must be {_UNION_FIELDS[field]}.", param=path)
    detail = first["msg"].rstrip(".")
    detail = detail[0].lower() + detail[1:]
    return APIError(400, f"Invalid value for '{path}': {detail}.", param=path)
