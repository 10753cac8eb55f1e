"""POST /v1/chat/completions: messages -> the model's chat template -> samples -> an assistant message.

Owns the chat request's rules (n, vLLM's `best_of`, vote, logprobs, `prompt_logprobs`, the token limit: the rest of
the context unless the request or the model's generation config says less), what constrains the output (an output
format, or `tool_choice` forcing calls) and which calls a reply may make (`parallel_tool_calls: false`: one;
`tool_choice: "required"`: none that repeats an earlier one), and the response, whole or streamed. Rendering the
conversation is `chat_prompt.py`'s; shaping each sample's text into `reasoning_content` / `content` / `tool_calls`
is `chat_format.py`'s; what a `vote` reads from a sample is its content (the vote itself is `voting.SampleVote`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from deltaspec.sample.params import SamplingParams
from deltaspec.server.chat_format import ChatFormat, call_watch
from deltaspec.server.chat_prompt import ChatPrompt, render_chat
from deltaspec.server.checks import (
    check_best_of,
    check_max_tokens,
    check_n,
    check_prompt_logprobs,
    check_seed,
    check_sequences,
)
from deltaspec.server.context import ServerContext
from deltaspec.server.dialects import unlimited
from deltaspec.server.errors import APIError
from deltaspec.server.logprobs import prompt_logprobs
from deltaspec.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from deltaspec.server.respond import Submitted
from deltaspec.server.samples import (
    Sample,
    best_samples,
    candidates,
    engine_error,
    merged,
    sampling_params,
    submit,
    usage_of,
)
from deltaspec.server.streaming import DONE, sse
from deltaspec.server.structured import forced_tool_calls, structured_outputs
from deltaspec.server.tool_calls import CallLimit

ENDPOINT = "chat"


@dataclass(frozen=True)
class ChatPlan:
    """A validated chat request: its rendered prompt, per-sample parameters and how outputs become messages."""

    request: ChatCompletionRequest
    prompt: ChatPrompt
    params: SamplingParams
    format: ChatFormat
    constraint_param: str | None  # the field an invalid output constraint is blamed on ("tool_choice" when forced)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids


def check_chat(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    """The rules a chat request must meet before its prompt is rendered; every problem is an APIError."""
    ctx.check_model(req.model)
    check_n(req.n, ctx.config.max_n)
    check_best_of(req)
    check_n(candidates(req), ctx.config.max_n, "best_of" if req.best_of else "n")
    check_sequences(1, candidates(req), ctx.config.max_sequences_per_request)
    check_seed(req.seed, candidates(req))
    if req.vote and req.n < 2:
        raise APIError(400, f"vote needs n of at least 2 samples, got n={req.n}.", param="vote")
    if req.vote and req.stream:
        raise APIError(400, "vote cannot be combined with stream; send the request without stream.", param="vote")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    check_prompt_logprobs(req)
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")


def max_tokens_of(ctx: ServerContext, req: ChatCompletionRequest, prompt_len: int) -> int:
    """The request's token limit, else the rest of the context, or less where the model's generation config says
    so (not with llama-server's `n_predict: -1`, which asks for the rest of the context)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        return max_tokens
    rest = max(ctx.max_model_len - prompt_len, 1)
    return rest if unlimited(req) else min(rest, ctx.sampling_defaults.get("max_tokens", rest))


def plan_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatPlan:
    """Validate a chat request, render its prompt and tokenize it; every problem is an APIError.

    Rendering and tokenizing a long conversation takes a while: the endpoint calls this on a worker thread.
    """
    check_chat(ctx, req)
    prompt = render_chat(ctx, req)
    top = (req.top_logprobs or 0) if req.logprobs else None
    forced = forced_tool_calls(
        prompt.tokenizer, prompt.tools, req.tool_choice, prompt.thinking, req.parallel_tool_calls
    )
    structured = structured_outputs(req)
    if structured is not None and forced is not None:
        raise APIError(
            400,
            "tool_choice forces a tool call and the request also constrains its output; give one.",
            param="tool_choice",
        )
    max_tokens = max_tokens_of(ctx, req, len(prompt.token_ids))
    params = sampling_params(req, max_tokens, top, ctx.sampling_defaults, structured or forced)
    calls = CallLimit(most=None if req.parallel_tool_calls else 1, distinct=req.tool_choice == "required")
    fmt = ChatFormat(prompt.tokenizer, prompt.thinking, prompt.tools, top, calls)
    return ChatPlan(req, prompt, params, fmt, "tool_choice" if forced else None)


def voted_choice(fmt: ChatFormat) -> Callable[[Sample], tuple[ChatChoice, str]]:
    """How a vote reads a finished sample: its choice (index 0) and the content its answer is taken from."""

    def choice_of(sample: Sample) -> tuple[ChatChoice, str]:
        choice = fmt.sample_choice(sample, index=0)
        return choice, choice.message.content or ""

    return choice_of


def submit_chat(ctx: ServerContext, plan: ChatPlan, request_id: str) -> list[Sample]:
    """Queue the plan's samples (`best_of` of them when given, else n)."""
    prompt = plan.prompt
    count = candidates(plan.request)
    return submit(
        ctx.engine,
        request_id,
        prompt.text,
        prompt.token_ids,
        plan.params,
        count,
        history_len=prompt.history_len,
        images=prompt.images,
    )


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request) -> Response:
    plan = await asyncio.to_thread(plan_chat, ctx, req)
    await ctx.constraints.compile(plan.params.structured_outputs, plan.constraint_param, request)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    arrival = time.time()
    samples = submit_chat(ctx, plan, request_id)
    submitted = Submitted(ctx, ENDPOINT, request_id, arrival, samples, len(plan.prompt_ids), req.n)
    if req.stream:
        return submitted.stream(lambda outcome: _stream_chat(ctx, plan, request_id, samples, outcome))
    vote = submitted.stop_once_decided(voted_choice(plan.format)) if req.vote else None

    def body() -> ChatCompletionResponse:
        if vote is not None:
            choice, info = vote.result()
            choices = [choice]
        else:
            answered, info = best_samples(samples, req.n), None
            choices = [plan.format.sample_choice(s, index=i) for i, s in enumerate(answered)]
        first = samples[0].prompt_logprobs
        return ChatCompletionResponse(
            id=request_id,
            model=ctx.model_name,
            choices=choices,
            usage=usage_of(len(plan.prompt_ids), samples),
            vote=info,
            prompt_logprobs=prompt_logprobs(first, plan.prompt.tokenizer) if first is not None else None,
        )

    return await submitted.whole(request, body, vote, call_watch(plan.format, ctx.engine))


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
            if choice is None:
                continue
            if choice.finish_reason is not None:
                finish_reasons[sample.index] = choice.finish_reason
                if not sample.finished:  # a call past the request's limit ended the reply: stop generating it
                    ctx.engine.abort(sample.request_id)
            yield chunk([choice])
    outcome["finish_reason"] = finish_reasons.get(samples[0].index) or "stop"
    options = plan.request.stream_options
    if options is not None and options.include_usage:
        yield chunk([], usage=usage_of(len(plan.prompt_ids), samples))
    yield DONE
