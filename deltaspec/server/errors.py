"""OpenAI-style error responses: `APIError`, its JSON body, and readable pydantic validation messages.

Every 4xx/5xx the server sends has the body `{"error": {"message", "type", "param", "code"}}` with
a message of one sentence; this module is the one place that shapes it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deltaspec.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 500: "server_error"}


class APIError(Exception):
    """A request the server answers with an error status and a one-sentence message."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        info = ErrorInfo(
            message=self.message,
            type=_TYPES.get(self.status, "invalid_request_error"),
            param=self.param,
            code=self.code if self.code is not None else self.status,
        )
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _field_path(loc: tuple) -> str:
    """`('messages', 0, 'content', 'str')` -> `messages[0].content`: stops at pydantic's union tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path += ("." if path else "") + part
        else:
            break
    return path


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body, in one sentence."""
    first = exc.errors()[0]
    path = _field_path(tuple(first["loc"]))
    if first["type"] == "missing":
        return APIError(400, f"The request is missing the required field '{path}'.", param=path)
    if not path:
        return APIError(400, "The request body must be a JSON object.")
    detail = first["msg"].rstrip(".")
    detail = detail[0].lower() + detail[1:]
    return APIError(400, f"Invalid value for '{path}': {detail}.", param=path)
