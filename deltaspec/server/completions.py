"""POST /v1/completions: raw prompts (text or token ids, one or many) -> n samples each.

Owns the prompt forms OpenAI accepts (a string, a list of strings, a token list, a list of token
lists), choice indexing (prompt p, sample i -> index p * n + i, as vLLM does), completion-style
logprobs (tokens, token_logprobs, top_logprobs, text_offset) and its SSE stream. `echo` is not
supported.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deltaspec.server.context import ServerContext
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.errors import APIError
from deltaspec.server.logprobs import completion_logprobs
from deltaspec.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from deltaspec.server.samples import (
    ClientDisconnected,
    Sample,
    abort_unfinished,
    check_max_tokens,
    check_n,
    collect,
    engine_error,
    merged,
    sampling_params,
    submit,
    usage_of,
)
from deltaspec.server.streaming import DONE, CleanupStreamingResponse, sse

ENDPOINT = "completions"


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def prompts_of(ctx: ServerContext, prompt: str | list) -> list[Prompt]:
    """The request's prompts, each as text (when given as text) and token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [Prompt(None, list(prompt))]
    if isinstance(prompt[0], list):
        return [Prompt(None, list(ids)) for ids in prompt]
    tokenizer = ctx.require_tokenizer("text prompts cannot be encoded")
    return [Prompt(text, tokenizer.encode(text)) for text in prompt]


def _choice(ctx: ServerContext, sample: Sample, logprobs: int | None) -> CompletionChoice:
    tokenizer = ctx.tokenizer
    text = sample.text(tokenizer) if tokenizer is not None else ""
    return CompletionChoice(
        index=sample.index,
        text=text,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        logprobs=completion_logprobs(sample.logprobs, logprobs, tokenizer) if logprobs is not None else None,
    )


async def create_completion(ctx: ServerContext, req: CompletionRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    check_n(req.n, ctx.config.max_n)
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.echo:
        raise APIError(400, "echo is not supported; send the request with echo false.", param="echo")
    prompts = prompts_of(ctx, req.prompt)
    if req.logprobs is not None and ctx.tokenizer is None:
        raise APIError(400, "logprobs need the token texts, but the model has no tokenizer.", param="logprobs")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    arrival = time.time()
    samples: list[Sample] = []
    try:
        for p, prompt in enumerate(prompts):
            max_tokens = (
                req.max_tokens if req.max_tokens is not None else max(ctx.max_model_len - len(prompt.token_ids), 1)
            )
            params = sampling_params(req, max_tokens, req.logprobs)
            samples += submit(ctx.engine, request_id, prompt.text, prompt.token_ids, params, req.n, p * req.n)
    except APIError:
        abort_unfinished(ctx.engine, samples)
        raise
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    if req.stream:
        outcome = {"finish_reason": "abort"}

        def close() -> None:
            abort_unfinished(ctx.engine, samples)
            ctx.record(ENDPOINT, request_id, arrival, samples, prompt_tokens, outcome["finish_reason"], req.n)

        return CleanupStreamingResponse(_stream(ctx, req, request_id, prompts, samples, outcome), close)

    finish_reason = "error"
    try:
        await collect(samples, request)
        if error := engine_error(samples):
            raise error
        body = CompletionResponse(
            id=request_id,
            model=ctx.model_name,
            choices=[_choice(ctx, s, req.logprobs) for s in samples],
            usage=usage_of(sum(len(p.token_ids) for p in prompts), samples),
        )
        finish_reason = body.choices[0].finish_reason or "stop"
        return JSONResponse(body.model_dump())
    except ClientDisconnected:
        finish_reason = "abort"
        return Response(status_code=499)
    finally:
        abort_unfinished(ctx.engine, samples)
        ctx.record(ENDPOINT, request_id, arrival, samples, prompt_tokens, finish_reason, req.n)


async def _stream(
    ctx: ServerContext,
    req: CompletionRequest,
    request_id: str,
    prompts: list[Prompt],
    samples: list[Sample],
    outcome: dict,
) -> AsyncIterator[str]:
    created = int(time.time())
    tokenizer = ctx.tokenizer

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        fields = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }
        if usage is not None:
            fields["usage"] = usage
        return sse(CompletionResponse(**fields))

    detokenizers = (
        {s.index: IncrementalDetokenizer(tokenizer, s.params.skip_special_tokens, s.params.stop) for s in samples}
        if tokenizer is not None
        else {}
    )
    offsets = dict.fromkeys(detokenizers, 0)
    finish_reasons: dict[int, str | None] = {}
    async with aclosing(merged(samples)) as deltas:
        async for sample, delta in deltas:
            if delta.finish_reason == "error":
                outcome["finish_reason"] = "error"
                yield sse(engine_error([sample]).body())
                yield DONE
                return
            text = ""
            if tokenizer is not None:
                detokenizer = detokenizers[sample.index]
                if delta.finished:
                    text = detokenizer.finish(delta.new_token_ids, delta.stop_text)
                else:
                    text = detokenizer.add(delta.new_token_ids)
            logprobs = None
            if req.logprobs is not None and delta.new_logprobs:
                logprobs = completion_logprobs(delta.new_logprobs, req.logprobs, tokenizer, offsets[sample.index])
                offsets[sample.index] += sum(len(t) for t in logprobs.tokens)
            if not text and logprobs is None and not delta.finished:
                continue
            ending = {"stop_reason": delta.stop_reason} if delta.finished else {}
            if delta.finished:
                finish_reasons[sample.index] = delta.finish_reason
            yield chunk(
                [
                    CompletionChoice(
                        index=sample.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason if delta.finished else None,
                        **ending,
                    )
                ]
            )
    outcome["finish_reason"] = finish_reasons.get(samples[0].index) or "stop"
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage=usage_of(sum(len(p.token_ids) for p in prompts), samples))
    yield DONE
