"""POST /v1/completions: raw prompts (text or token ids, one or many) -> n samples each.

Owns the prompt forms OpenAI accepts (a string, a list of strings, a token list, a list of token
lists), choice indexing (prompt p, sample i -> index p * n + i, as vLLM does), completion-style
logprobs (tokens, token_logprobs, top_logprobs, text_offset), its SSE stream, and `vote` over the
n samples of a single prompt (as on the chat endpoint: one choice, the majority answer). `echo` is
not supported. Without `max_tokens` a completion generates 16 tokens (OpenAI's and vLLM's default; llama-server's
`n_predict: -1`: the rest of the context). vLLM's `best_of` runs that many samples per prompt and answers the `n`
with the highest cumulative logprob; its `prompt_logprobs` come on each choice. Token ids on choices:
`return_token_ids` (vLLM's) adds `prompt_token_ids` and `token_ids` to each choice (the prompt's on its first
stream chunk only); a model without a tokenizer always sends `token_ids`, its only output (`text` is empty).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from deltaspec.server.checks import (
    check_best_of,
    check_max_tokens,
    check_n,
    check_prompt_logprobs,
    check_seed,
    check_sequences,
)
from deltaspec.server.context import ServerContext
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.dialects import unlimited
from deltaspec.server.errors import APIError
from deltaspec.server.logprobs import completion_logprobs, prompt_logprobs
from deltaspec.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from deltaspec.server.respond import Submitted
from deltaspec.server.samples import (
    Sample,
    abort_unfinished,
    best_samples,
    candidates,
    engine_error,
    merged,
    sampling_params,
    submit,
    usage_of,
)
from deltaspec.server.streaming import DONE, sse
from deltaspec.server.structured import structured_outputs

ENDPOINT = "completions"
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def prompt_count(prompt: str | list) -> int:
    """How many prompts the `prompt` field holds (before any is tokenized)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def prompts_of(ctx: ServerContext, prompt: str | list) -> list[Prompt]:
    """The request's prompts, each as text (when given as text) and token ids; runs on a worker thread."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [Prompt(None, list(prompt))]
    if isinstance(prompt[0], list):
        return [Prompt(None, list(ids)) for ids in prompt]
    tokenizer = ctx.require_tokenizer("text prompts cannot be encoded")
    return [Prompt(text, ctx.encode_prompt(tokenizer, text)) for text in prompt]


def max_tokens_of(ctx: ServerContext, req: CompletionRequest, prompt: Prompt) -> int:
    """The request's max_tokens, else 16, or less where the context or the model's generation config ends sooner
    (llama-server's `n_predict: -1`: the rest of the context)."""
    if req.max_tokens is not None:
        return req.max_tokens
    rest = max(ctx.max_model_len - len(prompt.token_ids), 1)
    if unlimited(req):
        return rest
    return min(DEFAULT_MAX_TOKENS, rest, ctx.sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS))


def sends_token_ids(ctx: ServerContext, req: CompletionRequest) -> bool:
    """Whether choices carry their generated token ids: when asked for, or when there is no text to send."""
    return req.return_token_ids or ctx.tokenizer is None


def _choice(
    ctx: ServerContext, req: CompletionRequest, prompts: list[Prompt], sample: Sample, index: int | None = None
) -> CompletionChoice:
    tokenizer = ctx.tokenizer
    text = sample.text(tokenizer) if tokenizer is not None else ""
    top = req.logprobs
    return CompletionChoice(
        index=sample.index if index is None else index,
        text=text,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        logprobs=completion_logprobs(sample.logprobs, top, tokenizer) if top is not None else None,
        prompt_token_ids=prompts[sample.index // candidates(req)].token_ids if req.return_token_ids else None,
        token_ids=list(sample.token_ids) if sends_token_ids(ctx, req) else None,
        prompt_logprobs=prompt_logprobs(sample.prompt_logprobs, tokenizer) if sample.prompt_logprobs else None,
    )


def answered(req: CompletionRequest, samples: list[Sample]) -> list[tuple[int, Sample]]:
    """(choice index, sample) of the samples a response answers with: the n best of each prompt's `best_of`."""
    per_prompt = candidates(req)
    out = []
    for p in range(len(samples) // per_prompt):
        best = best_samples(samples[p * per_prompt : (p + 1) * per_prompt], req.n)
        out += [(p * req.n + i, sample) for i, sample in enumerate(best)]
    return out


def check_completion(ctx: ServerContext, req: CompletionRequest) -> None:
    """The rules a completion request must meet before its prompts are tokenized; every problem is an APIError."""
    ctx.check_model(req.model)
    check_n(req.n, ctx.config.max_n)
    check_best_of(req)
    check_n(candidates(req), ctx.config.max_n, "best_of" if req.best_of else "n")
    check_sequences(prompt_count(req.prompt), candidates(req), ctx.config.max_sequences_per_request)
    check_seed(req.seed, candidates(req))
    check_prompt_logprobs(req)
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.echo:
        raise APIError(400, "echo is not supported; send the request with echo false.", param="echo")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(req, name) is not None and ctx.tokenizer is None:
            raise APIError(400, f"{name} need the token texts, but the model has no tokenizer.", param=name)
    if req.vote:
        if req.n < 2:
            raise APIError(400, f"vote needs n of at least 2 samples, got n={req.n}.", param="vote")
        if req.stream:
            raise APIError(400, "vote cannot be combined with stream; send the request without stream.", param="vote")
        if prompt_count(req.prompt) != 1:
            raise APIError(400, "vote needs a single prompt; send one prompt per request.", param="vote")
        if ctx.tokenizer is None:
            raise APIError(400, "vote reads the samples' answers, but the model has no tokenizer.", param="vote")


async def create_completion(ctx: ServerContext, req: CompletionRequest, request: Request) -> Response:
    check_completion(ctx, req)
    prompts = await asyncio.to_thread(prompts_of, ctx, req.prompt)
    structured = structured_outputs(req)
    await ctx.constraints.compile(structured, None, request)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    arrival = time.time()
    samples: list[Sample] = []
    try:
        for p, prompt in enumerate(prompts):
            max_tokens = max_tokens_of(ctx, req, prompt)
            params = sampling_params(req, max_tokens, req.logprobs, ctx.sampling_defaults, structured)
            count = candidates(req)
            samples += submit(ctx.engine, request_id, prompt.text, prompt.token_ids, params, count, p * count)
    except APIError:
        abort_unfinished(ctx.engine, samples)
        raise
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    submitted = Submitted(ctx, ENDPOINT, request_id, arrival, samples, prompt_tokens, req.n)
    if req.stream:
        return submitted.stream(lambda outcome: _stream(ctx, req, request_id, prompts, samples, outcome))

    def voted_choice(sample: Sample) -> tuple[CompletionChoice, str]:
        choice = _choice(ctx, req, prompts, sample, index=0)
        return choice, choice.text

    vote = submitted.stop_once_decided(voted_choice) if req.vote else None

    def body() -> CompletionResponse:
        if vote is None:
            choices, info = [_choice(ctx, req, prompts, s, index) for index, s in answered(req, samples)], None
        else:
            choice, info = vote.result()
            choices = [choice]
        usage = usage_of(prompt_tokens, samples)
        return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage, vote=info)

    return await submitted.whole(request, body, vote)


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
    with_ids = sends_token_ids(ctx, req)
    prompt_ids_due = {s.index for s in samples} if req.return_token_ids else set()
    finish_reasons: dict[int, str | None] = {}
    async with aclosing(merged(samples)) as deltas:
        async for sample, delta in deltas:
            if delta.finish_reason == "error":
                outcome["finish_reason"] = "error"
                yield sse(engine_error([sample]).body(ctx.redact))
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
            if not text and logprobs is None and not (with_ids and delta.new_token_ids) and not delta.finished:
                continue
            optional = {"stop_reason": delta.stop_reason} if delta.finished else {}
            if with_ids:
                optional["token_ids"] = delta.new_token_ids
            if sample.index in prompt_ids_due:
                prompt_ids_due.discard(sample.index)
                optional["prompt_token_ids"] = prompts[sample.index // req.n].token_ids
            if delta.finished:
                finish_reasons[sample.index] = delta.finish_reason
            yield chunk(
                [
                    CompletionChoice(
                        index=sample.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason if delta.finished else None,
                        **optional,
                    )
                ]
            )
    outcome["finish_reason"] = finish_reasons.get(samples[0].index) or "stop"
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage=usage_of(sum(len(p.token_ids) for p in prompts), samples))
    yield DONE
