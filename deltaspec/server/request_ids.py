"""Every HTTP request's id, and the log lines about a request that carry it.

`RequestIds`, an ASGI middleware, gives each request an id as soon as it arrives: the client's `X-Request-Id`
when that is a short printable token (as vLLM does), else a new one. The id goes back in the response's
`X-Request-Id` header, and `current_request_id()` returns it anywhere in the request's handling (a context
variable, which worker threads and the streaming task inherit). With `access_log` the middleware logs one
line per request: client, method, path, status, duration and id. It also turns an exception that escaped a
handler into a 500 for that request only, logged with its traceback. `log_error` logs an error response with
the id of the request it answers.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaspec.server.errors import APIError, printable

log = logging.getLogger("deltaspec.server")

HEADER = b"x-request-id"
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII without spaces, as a header value may carry
_request_id: ContextVar[str] = ContextVar("request_id", default="-")


def current_request_id() -> str:
    """The id of the HTTP request being handled ("-" outside one)."""
    return _request_id.get()


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when it is 1 to 128 printable ASCII characters without spaces, else a new id."""
    given = next((value.decode("latin-1") for name, value in headers if name.lower() == HEADER), None)
    if given is not None and _CLIENT_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def log_error(status: int, message: str) -> None:
    """Log an error response of the current request: a 4xx at INFO (the client's mistake), a 5xx at ERROR."""
    level = logging.ERROR if status >= 500 else logging.INFO
    log.log(level, "request %s: %d %s", current_request_id(), status, printable(message))


class RequestIds:
    """Request ids, the access log, and a 500 for an exception no handler caught (see the module docstring)."""

    def __init__(self, app: ASGIApp, access_log: bool, redact: Callable[[str], str]) -> None:
        self.app, self.access_log, self.redact = app, access_log, redact

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"])
        token = _request_id.set(request_id)
        began = time.perf_counter()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status is not None:  # the response began: the client sees the connection end
                log.error("request %s failed after its response began (%s: %s)", request_id, type(exc).__name__, exc)
                raise
            error = APIError(500, f"The server failed on this request ({type(exc).__name__}: {exc}).")
            log.exception("request %s: 500 %s", request_id, printable(error.message))
            await error.response(self.redact)(scope, receive, send_with_id)
        finally:
            if self.access_log:
                client = scope.get("client")
                log.info(
                    '%s "%s %s" %s %.1f ms request_id=%s',
                    f"{client[0]}:{client[1]}" if client else "-",
                    scope["method"],
                    printable(scope["path"]),
                    status if status is not None else "-",
                    (time.perf_counter() - began) * 1000,
                    request_id,
                )
            _request_id.reset(token)
