"""The Responses API's streamed events, as OpenAI sends them: `response.created` and `response.in_progress`; for
each output item `response.output_item.added`, its deltas and `.done` events (`response.reasoning_text.*`; a
message's `response.content_part.added`, `response.output_text.delta` / `.done` and `response.content_part.done`;
a call's `response.function_call_arguments.delta` / `.done`) and `response.output_item.done`; then
`response.completed` (or `response.incomplete`) with the whole Response. Each is an SSE event with `event: TYPE`
and a `sequence_number`; no `[DONE]` follows. An engine failure ends the stream with an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from deltaspec.server.chat import ChatPlan
from deltaspec.server.context import ServerContext
from deltaspec.server.responses_output import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_tokens,
    response_object,
    response_usage,
    status_of,
    text_part,
)
from deltaspec.server.responses_protocol import ResponsesRequest
from deltaspec.server.samples import Sample, engine_error, merged, usage_of


class ResponseEvents:
    """One streamed response's events, in order: the output items closed so far and the one being streamed."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being streamed, at output index len(self.output)
        self.text = ""  # its text so far

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _start(self, item: dict) -> list[str]:
        events = self.close()
        self.open, self.text = item, ""
        return [*events, self.event("response.output_item.added", output_index=len(self.output), item=item)]

    def reasoning(self, text: str) -> list[str]:
        events = []
        if not (self.open and self.open["type"] == "reasoning"):
            events = self._start(reasoning_item(new_id("rs"), "", "in_progress"))
        self.text += text
        return [*events, self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]

    def content(self, text: str) -> list[str]:
        events = []
        if not (self.open and self.open["type"] == "message"):
            events = self._start(message_item(new_id("msg"), None, "in_progress"))
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=text_part(""))
            )
        self.text += text
        delta = self.event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
        return [*events, delta]

    def call(self, call: dict) -> list[str]:
        """A whole tool call (as a chat stream delta carries it): its item added, its arguments, its item done."""
        function = call["function"]
        events = self._start(call_item(new_id("fc"), call["id"], function["name"], "", "in_progress"))
        arguments = function["arguments"]
        events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        events.append(self.event("response.function_call_arguments.done", **self._where(), arguments=arguments))
        self.open = {**self.open, "arguments": arguments}
        return [*events, *self.close()]

    def close(self) -> list[str]:
        """The `.done` events of the item being streamed (none when there is none)."""
        if self.open is None:
            return []
        item, where, events = self.open, self._where(), []
        if item["type"] == "reasoning":
            item = reasoning_item(item["id"], self.text)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
        elif item["type"] == "message":
            item = message_item(item["id"], self.text)
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=text_part(self.text)))
        else:
            item = {**item, "status": "completed"}
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.open, self.text = None, ""
        return events


async def stream_response(
    ctx: ServerContext,
    req: ResponsesRequest,
    plan: ChatPlan,
    response_id: str,
    created: float,
    sample: Sample,
    outcome: dict,
) -> AsyncIterator[str]:
    """The events of one response's reply, from its sample's deltas; sets `outcome["finish_reason"]`."""
    events = ResponseEvents()

    def snapshot(status: str, usage: dict | None = None) -> dict:
        return response_object(ctx, req, plan, response_id, created, status, events.output, usage)

    yield events.event("response.created", response=snapshot("in_progress"))
    yield events.event("response.in_progress", response=snapshot("in_progress"))
    stream = plan.format.stream(0, sample.params)
    finish_reason = None
    async with aclosing(merged([sample])) as deltas:
        async for _, delta in deltas:
            if delta.finish_reason == "error":
                outcome["finish_reason"] = "error"
                error = engine_error([sample])
                yield events.event("error", code=str(error.status), message=ctx.redact(error.message), param=None)
                return
            choice = stream.feed(delta)
            if choice is None:
                continue
            pieces = choice.delta
            out = events.reasoning(pieces.reasoning_content) if pieces.reasoning_content else []
            out += events.content(pieces.content) if pieces.content else []
            for call in pieces.tool_calls or []:
                out += events.call(call)
            for event in out:
                yield event
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
                break
    for event in events.close():
        yield event
    outcome["finish_reason"] = finish_reason or "stop"
    status = status_of(finish_reason)
    usage = response_usage(usage_of(len(plan.prompt_ids), [sample]), reasoning_tokens(plan, events.output))
    yield events.event(f"response.{status}", response=snapshot(status, usage))
