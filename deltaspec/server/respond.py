"""How a request whose samples are in the engine ends, for both endpoints: streamed, or whole.

`Submitted` holds one HTTP request's samples and what its request-log line needs. A whole response
waits for every sample (feeding the request's vote, when it asked for one, which stops sampling once
decided), then answers with the body the endpoint builds, a 500 when the engine failed, or nothing
(499) when the client left. However a request ends, its unfinished samples are aborted, it is
counted and logged exactly once, and each sample the engine failed is logged with the request's id.
Every delta its samples receive adds to the server's token counts (`TokenTally`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deltaspec.engine.async_engine import SHUTDOWN_ERROR, RequestDelta
from deltaspec.server.context import ServerContext
from deltaspec.server.request_ids import current_request_id
from deltaspec.server.samples import ClientDisconnected, Sample, abort_unfinished, collect, engine_error
from deltaspec.server.streaming import CleanupStreamingResponse
from deltaspec.server.voting import SampleVote

log = logging.getLogger("deltaspec.server")


@dataclass(frozen=True)
class Submitted:
    """One HTTP request's samples in the engine."""

    ctx: ServerContext
    endpoint: str
    request_id: str
    arrival: float
    samples: list[Sample]
    prompt_tokens: int
    n: int

    def __post_init__(self) -> None:
        for sample in self.samples:
            sample.tally = self.ctx.metrics.tally

    def end(self, finish_reason: str) -> None:
        """Abort the samples that have not finished, log those the engine failed, and count the request in the
        metrics and the request log."""
        abort_unfinished(self.ctx.engine, self.samples)
        for sample in self.samples:
            if sample.finish_reason != "error":
                continue
            if sample.error == SHUTDOWN_ERROR:
                log.warning("request %s: sample %s was ended by the shutdown", current_request_id(), sample.request_id)
            else:
                log.error(
                    "request %s: sample %s failed in the engine: %s",
                    current_request_id(),
                    sample.request_id,
                    sample.error,
                )
        self.ctx.record(
            self.endpoint, self.request_id, self.arrival, self.samples, self.prompt_tokens, finish_reason, self.n
        )

    def stream(self, events: Callable[[dict], AsyncIterator[str]]) -> CleanupStreamingResponse:
        """An SSE response of `events(outcome)`, which sets `outcome["finish_reason"]` when it gets that far."""
        outcome = {"finish_reason": "abort"}
        return CleanupStreamingResponse(events(outcome), lambda: self.end(outcome["finish_reason"]))

    def stop_once_decided(self, choice_of: Callable[[Sample], tuple]) -> SampleVote:
        """A vote over these samples that aborts the unfinished ones once it is decided."""
        return SampleVote(self.samples, choice_of, lambda: abort_unfinished(self.ctx.engine, self.samples))

    async def whole(
        self,
        request: Request,
        body: Callable[[], BaseModel | dict],
        vote: SampleVote | None = None,
        on_delta: Callable[[Sample, RequestDelta], None] | None = None,
        finish_reason_of: Callable[[BaseModel], str | None] = lambda response: response.choices[0].finish_reason,
    ) -> Response:
        """Wait for every sample (`on_delta` sees each delta as it comes), then answer with `body()` (a model's
        `vote` field left out when it has none); `finish_reason_of` reads the request log's finish reason from it."""
        finish_reason = "error"
        try:
            await collect(self.samples, request, vote.on_finished if vote is not None else None, on_delta)
            if error := engine_error(self.samples):
                raise error
            response = body()
            finish_reason = finish_reason_of(response) or "stop"
            if isinstance(response, dict):
                return JSONResponse(response)
            left_out = {"vote"} if getattr(response, "vote", None) is None else None
            return JSONResponse(response.model_dump(exclude=left_out))
        except ClientDisconnected:
            finish_reason = "abort"
            return Response(status_code=499)
        finally:
            self.end(finish_reason)
