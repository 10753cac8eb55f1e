"""POST /v1/chat/completions: messages -> the model's chat template -> samples -> an assistant message.

Owns the chat-specific rules: turning OpenAI messages and tools into the template's input
(`tool_choice` "none" passes no tools, a named choice passes only that tool), whether the output
starts inside a think block (the rendered prompt ends with `<think>`), shaping each sample's text
into `reasoning_content` / `content` / `tool_calls` (whole-text and streamed, by the same rules),
which `chat_template_kwargs` the template may get (not the renderer's own globals), and what a
`vote` reads from a sample (its content; the vote itself is `voting.SampleVote`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from deltaspec.engine.async_engine import RequestDelta
from deltaspec.errors import DeltaspecError
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.logprobs import Logprob
from deltaspec.sample.params import SamplingParams
from deltaspec.server.checks import check_max_tokens, check_n, check_seed, check_sequences
from deltaspec.server.context import ServerContext
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.errors import APIError, shown
from deltaspec.server.logprobs import chat_logprobs
from deltaspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    NamedToolChoice,
    ToolCallFunction,
    ToolCallOut,
    UsageInfo,
)
from deltaspec.server.reasoning import ReasoningStream, split_reasoning
from deltaspec.server.respond import Submitted
from deltaspec.server.samples import Sample, engine_error, merged, sampling_params, submit, usage_of
from deltaspec.server.streaming import DONE, sse
from deltaspec.server.structured import forced_tool_calls, structured_outputs
from deltaspec.server.tool_calls import ToolCallStream, parse_tool_calls

ENDPOINT = "chat"
_REQUEST_FIELDS = ("messages", "tools", "add_generation_prompt")
# What the template's renderer provides itself: its helpers, the special tokens and Jinja's own globals.
_TEMPLATE_GLOBALS = (
    "raise_exception",
    "strftime_now",
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "range",
    "dict",
    "lipsum",
    "cycler",
    "joiner",
    "namespace",
)


def _part_text(message_index: int, content: list) -> str:
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{message_index}].content[{j}]"
        if part.type != "text":
            raise APIError(
                400,
                f"{where} is a {shown(part.type)} part, but only text parts are supported.",
                param=f"messages[{message_index}].content",
            )
        if part.text is None:
            raise APIError(400, f"{where} is a text part without 'text'; add its text.", param=f"{where}.text")
        texts.append(part.text)
    return "\n".join(texts)


def _tool_call_for_template(call: dict) -> dict:
    """A history tool call with JSON-object arguments parsed into a dict, as templates expect (vLLM does this)."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            call = {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages as chat-template dicts: text parts joined, `developer` read as `system`."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None and message.role != "assistant":
            raise APIError(
                400, f"messages[{i}] ({shown(message.role)}) needs a content.", param=f"messages[{i}].content"
            )
        item: dict = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _part_text(i, content) if isinstance(content, list) else content,
        }
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        if message.tool_calls:
            item["tool_calls"] = [_tool_call_for_template(c.model_dump(exclude_none=True)) for c in message.tool_calls]
        out.append(item)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools given to the template (and parsed from the output), or None for no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools.", param="tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise APIError(
                400,
                f"tool_choice names the function {shown(choice.function.name)}, "
                "which is not among the request's tools.",
                param="tool_choice",
            )
    return tools


@dataclass(frozen=True)
class ChatFormat:
    """How one request's sample outputs become assistant messages (whole or streamed)."""

    tokenizer: Tokenizer
    started_in_thinking: bool
    tools: list[dict] | None  # None: tool calls are not parsed
    top_logprobs: int | None  # None: no logprobs

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
    """One sample's stream chunks: text deltas split into reasoning, content and tool-call deltas."""

    def __init__(self, fmt: ChatFormat, index: int, params: SamplingParams) -> None:
        self.fmt = fmt
        self.index = index
        self.detokenizer = IncrementalDetokenizer(fmt.tokenizer, params.skip_special_tokens, params.stop)
        self.reasoning = ReasoningStream(fmt.started_in_thinking)
        self.tool_calls = ToolCallStream(fmt.tools) if fmt.tools is not None else None

    def feed(self, delta: RequestDelta) -> ChatChunkChoice | None:
        """The chunk choice for one engine delta, or None when it adds nothing to send yet."""
        if delta.finished:
            text = self.detokenizer.finish(delta.new_token_ids, delta.stop_text)
        else:
            text = self.detokenizer.add(delta.new_token_ids)
        reasoning, content = self.reasoning.feed(text)
        if delta.finished:
            more_reasoning, more_content = self.reasoning.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict] = []
        if self.tool_calls is not None:
            content, calls = self.tool_calls.feed(content)
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
        if not fields and logprobs is None and not delta.finished:
            return None
        finish_reason = delta.finish_reason
        if finish_reason == "stop" and self.tool_calls is not None and self.tool_calls.has_calls:
            finish_reason = "tool_calls"
        ending = {"stop_reason": delta.stop_reason} if delta.finished else {}
        return ChatChunkChoice(
            index=self.index,
            delta=DeltaMessage(**fields),
            logprobs=logprobs,
            finish_reason=finish_reason if delta.finished else None,
            **ending,
        )


@dataclass(frozen=True)
class ChatPlan:
    """A validated chat request: its rendered prompt, token ids and per-sample parameters."""

    request: ChatCompletionRequest
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    format: ChatFormat
    history_len: int  # prompt tokens the next turn will share: the messages rendered without the generation prompt
    constraint_param: str | None  # the field an invalid output constraint is blamed on ("tool_choice" when forced)


def _check_template_kwargs(kwargs: dict) -> None:
    for key in kwargs:
        if key in _REQUEST_FIELDS:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set '{key}'; use the request field instead.",
                param=f"chat_template_kwargs.{key}",
            )
        if key in _TEMPLATE_GLOBALS:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set '{key}', which the chat template's renderer reserves; remove it.",
                param=f"chat_template_kwargs.{key}",
            )


def check_chat(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    """The rules a chat request must meet before its prompt is rendered; every problem is an APIError."""
    ctx.check_model(req.model)
    if not req.messages:
        raise APIError(400, "messages must contain at least one message.", param="messages")
    check_n(req.n, ctx.config.max_n)
    check_sequences(1, req.n, ctx.config.max_sequences_per_request)
    check_seed(req.seed, req.n)
    if req.vote and req.n < 2:
        raise APIError(400, f"vote needs n of at least 2 samples, got n={req.n}.", param="vote")
    if req.vote and req.stream:
        raise APIError(400, "vote cannot be combined with stream; send the request without stream.", param="vote")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    _check_template_kwargs(req.chat_template_kwargs or {})


def plan_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatPlan:
    """Validate a chat request, render its prompt and tokenize it; every problem is an APIError.

    Rendering and tokenizing a long conversation takes a while: the endpoint calls this on a worker thread.
    """
    check_chat(ctx, req)
    tokenizer = ctx.require_tokenizer("chat messages cannot be rendered")
    tools = template_tools(req)
    messages, options = template_messages(req.messages), req.chat_template_kwargs or {}
    try:
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt, **options
        )
        prompt_ids = ctx.encode_prompt(tokenizer, prompt)
        history_len = tokenizer.history_length(prompt_ids, messages, tools=tools, **options)
    except DeltaspecError as exc:
        raise APIError(400, str(exc)) from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # the rest of the context, or less where the model's generation config says so
        rest = max(ctx.max_model_len - len(prompt_ids), 1)
        max_tokens = min(rest, ctx.sampling_defaults.get("max_tokens", rest))
    top = (req.top_logprobs or 0) if req.logprobs else None
    thinking = prompt.rstrip().endswith("<think>")
    structured, forced = structured_outputs(req), forced_tool_calls(tokenizer, tools, req.tool_choice, thinking)
    if structured is not None and forced is not None:
        raise APIError(
            400,
            "tool_choice forces a tool call and the request also constrains its output; give one.",
            param="tool_choice",
        )
    params = sampling_params(req, max_tokens, top, ctx.sampling_defaults, structured or forced)
    fmt = ChatFormat(tokenizer, thinking, tools, top)
    return ChatPlan(req, prompt, prompt_ids, params, fmt, history_len, "tool_choice" if forced else None)


def voted_choice(fmt: ChatFormat) -> Callable[[Sample], tuple[ChatChoice, str]]:
    """How a vote reads a finished sample: its choice (index 0) and the content its answer is taken from."""

    def choice_of(sample: Sample) -> tuple[ChatChoice, str]:
        choice = fmt.sample_choice(sample, index=0)
        return choice, choice.message.content or ""

    return choice_of


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request) -> Response:
    plan = await asyncio.to_thread(plan_chat, ctx, req)
    await ctx.constraints.compile(plan.params.structured_outputs, plan.constraint_param, request)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    arrival = time.time()
    samples = submit(
        ctx.engine, request_id, plan.prompt, plan.prompt_ids, plan.params, req.n, history_len=plan.history_len
    )
    submitted = Submitted(ctx, ENDPOINT, request_id, arrival, samples, len(plan.prompt_ids), req.n)
    if req.stream:
        return submitted.stream(lambda outcome: _stream_chat(ctx, plan, request_id, samples, outcome))
    vote = submitted.stop_once_decided(voted_choice(plan.format)) if req.vote else None

    def body() -> ChatCompletionResponse:
        if vote is None:
            choices, info = [plan.format.sample_choice(s) for s in samples], None
        else:
            choice, info = vote.result()
            choices = [choice]
        usage = usage_of(len(plan.prompt_ids), samples)
        return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage, vote=info)

    return await submitted.whole(request, body, vote)


async def _stream_chat(
    ctx: ServerContext, plan: ChatPlan, request_id: str, samples: list[Sample], outcome: dict
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        fields = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }
        if usage is not None:
            fields["usage"] = usage
        return sse(ChatCompletionChunk(**fields))

    streams = {s.index: plan.format.stream(s.index, s.params) for s in samples}
    for sample in samples:
        yield chunk(
            [
                ChatChunkChoice(
                    index=sample.index,
                    delta=DeltaMessage(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
            ]
        )
    finish_reasons: dict[int, str | None] = {}
    async with aclosing(merged(samples)) as deltas:
        async for sample, delta in deltas:
            if delta.finish_reason == "error":
                outcome["finish_reason"] = "error"
                yield sse(engine_error([sample]).body(ctx.redact))
                yield DONE
                return
            choice = streams[sample.index].feed(delta)
            if choice is not None:
                if delta.finished:
                    finish_reasons[sample.index] = choice.finish_reason
                yield chunk([choice])
    outcome["finish_reason"] = finish_reasons.get(samples[0].index) or "stop"
    options = plan.request.stream_options
    if options is not None and options.include_usage:
        yield chunk([], usage=usage_of(len(plan.prompt_ids), samples))
    yield DONE
