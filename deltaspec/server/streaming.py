"""Server-sent events: the `data: {json}\\n\\n` framing, the final `[DONE]`, and a streaming response
that runs a cleanup callback however the stream ends (finished, client gone, or never started),
so engine requests of a vanished client are always aborted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    """One SSE event; pydantic payloads are dumped with only the fields that were set."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_unset=True)
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


class CleanupStreamingResponse(StreamingResponse):
    """An SSE `StreamingResponse` that calls `on_close` once the response is over, however it ended."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
