"""A chat sample's output text -> an assistant message: `reasoning_content`, `content` and `tool_calls`, whole
(`ChatFormat.choice`) or streamed (`ChatStream`), by the same rules.

Whether the output starts inside a think block decides where reasoning ends (`reasoning.py`); tool calls are
parsed from the content when the request has tools (`tool_calls.py`). A `CallLimit` ends the reply before the
first call past it (`parallel_tool_calls: false`: one call; `tool_choice: "required"`: no call that repeats an
earlier one): what follows is dropped and the finish reason is "tool_calls", as for any reply that ends with calls.
`CallWatch` stops generating such a reply once the call past the limit arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaspec.engine.async_engine import AsyncEngine, RequestDelta
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.logprobs import Logprob
from deltaspec.sample.params import SamplingParams
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.logprobs import chat_logprobs
from deltaspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    DeltaMessage,
    ToolCallFunction,
    ToolCallOut,
)
from deltaspec.server.reasoning import ReasoningStream, split_reasoning
from deltaspec.server.samples import Sample
from deltaspec.server.tool_calls import CallLimit, ToolCallStream, cut_at_limit, parse_tool_calls


@dataclass(frozen=True)
class ChatFormat:
    """How one request's sample outputs become assistant messages (whole or streamed)."""

    tokenizer: Tokenizer
    started_in_thinking: bool
    tools: list[dict] | None  # None: tool calls are not parsed
    top_logprobs: int | None  # None: no logprobs
    calls: CallLimit = CallLimit()

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        logprobs: list[dict[int, Logprob]],
    ) -> ChatChoice:
        reasoning, content = split_reasoning(text, self.started_in_thinking)
        calls = []
        if self.tools is not None:
            if (cut := cut_at_limit(content, self.tools, self.calls)) is not None:
                content, finish_reason = cut, "stop"
            content, calls = parse_tool_calls(content, self.tools)
        message = AssistantMessage(
            content=content if content or not calls else None,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCallOut(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in calls
            ],
        )
        return ChatChoice(
            index=index,
            message=message,
            finish_reason="tool_calls" if calls and finish_reason == "stop" else finish_reason,
            stop_reason=stop_reason,
            logprobs=chat_logprobs(logprobs, self.top_logprobs, self.tokenizer)
            if self.top_logprobs is not None
            else None,
        )

    def sample_choice(self, sample: Sample, index: int | None = None) -> ChatChoice:
        return self.choice(
            sample.index if index is None else index,
            sample.text(self.tokenizer),
            sample.finish_reason,
            sample.stop_reason,
            sample.logprobs,
        )

    def stream(self, index: int, params: SamplingParams) -> ChatStream:
        return ChatStream(self, index, params)


class ChatStream:
    """One sample's stream chunks: text deltas split into reasoning, content and tool-call deltas; the chunk that
    ends it (`done`) comes with the sample's last delta, or with a call past the request's `CallLimit`."""

    def __init__(self, fmt: ChatFormat, index: int, params: SamplingParams) -> None:
        self.fmt = fmt
        self.index = index
        self.detokenizer = IncrementalDetokenizer(fmt.tokenizer, params.skip_special_tokens, params.stop)
        self.reasoning = ReasoningStream(fmt.started_in_thinking)
        self.tool_calls = ToolCallStream(fmt.tools, limit=fmt.calls) if fmt.tools is not None else None
        self.done = False

    def feed(self, delta: RequestDelta) -> ChatChunkChoice | None:
        """The chunk choice for one engine delta, or None when it adds nothing to send yet (or the stream is done)."""
        if self.done:
            return None
        if delta.finished:
            text = self.detokenizer.finish(delta.new_token_ids, delta.stop_text)
        else:
            text = self.detokenizer.add(delta.new_token_ids)
        reasoning, content = self.reasoning.feed(text)
        if delta.finished:
            more_reasoning, more_content = self.reasoning.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict] = []
        cut = False
        if self.tool_calls is not None:
            content, calls = self.tool_calls.feed(content)
            cut = self.tool_calls.ended
            if delta.finished:
                more_content, more_calls = self.tool_calls.flush()
                content, calls = content + more_content, calls + more_calls
        fields: dict = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = calls
        logprobs = None
        if self.fmt.top_logprobs is not None and delta.new_logprobs:
            logprobs = chat_logprobs(delta.new_logprobs, self.fmt.top_logprobs, self.fmt.tokenizer)
        self.done = delta.finished or cut
        if not fields and logprobs is None and not self.done:
            return None
        finish_reason = "stop" if cut else delta.finish_reason
        if finish_reason == "stop" and self.tool_calls is not None and self.tool_calls.has_calls:
            finish_reason = "tool_calls"
        ending = {"stop_reason": None if cut else delta.stop_reason} if self.done else {}
        return ChatChunkChoice(
            index=self.index,
            delta=DeltaMessage(**fields),
            logprobs=logprobs,
            finish_reason=finish_reason if self.done else None,
            **ending,
        )


def call_watch(fmt: ChatFormat, engine: AsyncEngine) -> Callable[[Sample, RequestDelta], None] | None:
    """For a whole (not streamed) reply under a `CallLimit`: a delta hook that stops generating a sample once a
    call past the limit arrives (its text is then cut there by `ChatFormat.choice`); None without a limit."""
    if fmt.tools is None or not fmt.calls.limits:
        return None
    streams: dict[int, ChatStream] = {}

    def on_delta(sample: Sample, delta: RequestDelta) -> None:
        stream = streams.setdefault(sample.index, fmt.stream(sample.index, sample.params))
        stream.feed(delta)
        if stream.done and not sample.finished:
            engine.abort(sample.request_id)

    return on_delta
