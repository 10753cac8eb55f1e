"""POST /v1/responses: OpenAI's Responses API, served as the chat completion it reads as (`responses_protocol.py`),
answered whole as one Response object (`responses_output.py`) or streamed as its events (`responses_stream.py`).
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import Response

from deltaspec.server.chat import plan_chat, submit_chat
from deltaspec.server.chat_format import call_watch
from deltaspec.server.context import ServerContext
from deltaspec.server.respond import Submitted
from deltaspec.server.responses_output import (
    new_id,
    output_items,
    reasoning_tokens,
    response_object,
    response_usage,
    status_of,
)
from deltaspec.server.responses_protocol import ResponsesRequest, to_chat
from deltaspec.server.responses_stream import stream_response
from deltaspec.server.samples import usage_of

ENDPOINT = "responses"


async def create_response(ctx: ServerContext, req: ResponsesRequest, request: Request) -> Response:
    chat = to_chat(req)
    plan = await asyncio.to_thread(plan_chat, ctx, chat)
    await ctx.constraints.compile(plan.params.structured_outputs, plan.constraint_param, request)
    response_id, created = new_id("resp"), time.time()
    samples = submit_chat(ctx, plan, response_id)
    submitted = Submitted(ctx, ENDPOINT, response_id, created, samples, len(plan.prompt_ids), 1)
    if req.stream:
        return submitted.stream(
            lambda outcome: stream_response(ctx, req, plan, response_id, created, samples[0], outcome)
        )
    finish: dict[str, str | None] = {}

    def body() -> dict:
        choice = plan.format.sample_choice(samples[0], index=0)
        finish["reason"] = choice.finish_reason
        output = output_items(choice)
        usage = response_usage(usage_of(len(plan.prompt_ids), samples), reasoning_tokens(plan, output))
        return response_object(ctx, req, plan, response_id, created, status_of(choice.finish_reason), output, usage)

    watch = call_watch(plan.format, ctx.engine)
    return await submitted.whole(request, body, None, watch, finish_reason_of=lambda _: finish["reason"])
