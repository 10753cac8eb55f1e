"""llama-server's own `POST /completion`, in its request and response shapes.

Request: `prompt` (a string or token ids), `n_predict` (default -1: until the model ends or the context is full,
or the model's generation config's limit), `stream`, `return_tokens`, and the sampling fields every endpoint reads
(`temperature`, `top_k`, `top_p`, `min_p`, `stop`, `seed`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty`, `ignore_eos`, `json_schema`; `dialects.py`). Unset sampling fields take the model's
generation config, as on /v1, not llama-server's own defaults. `cache_prompt` and `id_slot` are accepted and
change nothing here (prompts are always cached; there are no slots to pick).

Response: `{"content", "tokens", "stop": true, "stop_type": "eos" | "word" | "limit", "stopping_word",
"tokens_predicted", "tokens_evaluated", "tokens_cached", "timings", "generation_settings", "prompt", "model", ...}`;
streamed, one `data: {"content", "stop": false, ...}` event per piece of text, then that final object (whose
`content` is the text not sent yet), and no `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import Response

from deltaspec.sample.params import SamplingParams
from deltaspec.server.checks import check_max_tokens
from deltaspec.server.completions import Prompt, prompts_of
from deltaspec.server.context import ServerContext
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.dialects import unlimited
from deltaspec.server.errors import APIError
from deltaspec.server.protocol import SamplingFields
from deltaspec.server.respond import Submitted
from deltaspec.server.samples import Sample, engine_error, merged, sampling_params, submit
from deltaspec.server.streaming import sse
from deltaspec.server.structured import structured_outputs

ENDPOINT = "completion"


class LlamaCompletionRequest(SamplingFields):
    prompt: str | list[int]
    return_tokens: bool = False
    cache_prompt: bool = True
    id_slot: int = -1


def check_llama(ctx: ServerContext, req: LlamaCompletionRequest) -> None:
    """What /completion does not do, refused in one sentence naming where it is done."""
    ctx.check_model(req.model)
    for name, unset in (("n", 1), ("best_of", None), ("prompt_logprobs", None)):
        if getattr(req, name) != unset:
            raise APIError(400, f"/completion does not take {name}; send it to /v1/completions.", param=name)
    check_max_tokens(req.max_tokens, "max_tokens")


def _max_tokens(ctx: ServerContext, req: LlamaCompletionRequest, prompt: Prompt) -> int:
    if req.max_tokens is not None:
        return req.max_tokens
    rest = max(ctx.max_model_len - len(prompt.token_ids), 1)
    return rest if unlimited(req) else min(rest, ctx.sampling_defaults.get("max_tokens", rest))


def stop_type(sample: Sample) -> str:
    """llama-server's `stop_type`: "word" for a stop string, "limit" for the token limit, else "eos"."""
    if sample.finish_reason == "length":
        return "limit"
    return "word" if isinstance(sample.stop_reason, str) else "eos"


def _timings(sample: Sample) -> dict:
    """llama-server's `timings`, from the engine's times of the sample."""
    metrics = sample.metrics
    cached = metrics.get("num_cached_tokens", 0)
    prompt_n, predicted_n = sample.num_prompt_tokens - cached, len(sample.token_ids)
    prompt_ms = 1000 * (metrics.get("time_to_first_token") or 0.0)
    predicted_ms = 1000 * (metrics.get("decode_time") or 0.0)
    return {
        "cache_n": cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(predicted_n - 1, 1),
        "predicted_per_second": 1000 * (predicted_n - 1) / predicted_ms if predicted_ms else 0.0,
    }


def _settings(req: LlamaCompletionRequest, params: SamplingParams) -> dict:
    """llama-server's `generation_settings`: what this request sampled with."""
    return {
        "n_predict": -1 if unlimited(req) else params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "seed": params.seed if params.seed is not None else -1,
        "stop": params.stop,
        "ignore_eos": params.ignore_eos,
        "stream": req.stream,
    }


def final(ctx: ServerContext, req: LlamaCompletionRequest, prompt: Prompt, sample: Sample, content: str) -> dict:
    """llama-server's last object of a completion, with `content` (all of it, or what a stream had not sent)."""
    text = sample.text(ctx.tokenizer)
    return {
        "index": 0,
        "content": content,
        "tokens": list(sample.token_ids) if req.return_tokens else [],
        "id_slot": req.id_slot,
        "stop": True,
        "model": ctx.model_name,
        "tokens_predicted": len(sample.token_ids),
        "tokens_evaluated": len(prompt.token_ids),
        "generation_settings": _settings(req, sample.params),
        "prompt": prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids, False),
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": stop_type(sample),
        "stopping_word": sample.stop_reason if isinstance(sample.stop_reason, str) else "",
        "tokens_cached": len(prompt.token_ids) + len(sample.token_ids),
        "timings": _timings(sample),
    }


async def create_llama_completion(ctx: ServerContext, req: LlamaCompletionRequest, request: Request) -> Response:
    check_llama(ctx, req)
    ctx.require_tokenizer("/completion answers with text")
    [prompt] = await asyncio.to_thread(prompts_of, ctx, req.prompt)
    structured = structured_outputs(req)
    await ctx.constraints.compile(structured, None, request)
    params = sampling_params(req, _max_tokens(ctx, req, prompt), None, ctx.sampling_defaults, structured)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    samples = submit(ctx.engine, request_id, prompt.text, prompt.token_ids, params, 1)
    submitted = Submitted(ctx, ENDPOINT, request_id, time.time(), samples, len(prompt.token_ids), 1)
    if req.stream:
        return submitted.stream(lambda outcome: _stream(ctx, req, prompt, samples[0], outcome))

    def body() -> dict:
        sample = samples[0]
        return final(ctx, req, prompt, sample, sample.text(ctx.tokenizer))

    return await submitted.whole(request, body, finish_reason_of=lambda _: samples[0].finish_reason)


async def _stream(
    ctx: ServerContext, req: LlamaCompletionRequest, prompt: Prompt, sample: Sample, outcome: dict
) -> AsyncIterator[str]:
    detokenizer = IncrementalDetokenizer(ctx.tokenizer, sample.params.skip_special_tokens, sample.params.stop)
    async with aclosing(merged([sample])) as deltas:
        async for _, delta in deltas:
            if delta.finish_reason == "error":
                outcome["finish_reason"] = "error"
                yield sse(engine_error([sample]).body(ctx.redact))
                return
            if delta.finished:
                outcome["finish_reason"] = delta.finish_reason
                yield sse(final(ctx, req, prompt, sample, detokenizer.finish(delta.new_token_ids, delta.stop_text)))
                return
            text = detokenizer.add(delta.new_token_ids)
            if text:
                piece = {
                    "index": 0,
                    "content": text,
                    "tokens": delta.new_token_ids if req.return_tokens else [],
                    "stop": False,
                    "id_slot": req.id_slot,
                    "tokens_predicted": len(sample.token_ids),
                    "tokens_evaluated": len(prompt.token_ids),
                }
                yield sse(piece)
