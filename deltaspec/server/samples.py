"""Running one HTTP request's samples on the `AsyncEngine`: submit, collect, merge, abort.

A request with `n` samples becomes `n` engine requests `{id}-{i}` (seeded `seed + i` when a seed
is given); with vLLM's `best_of`, `best_of` of them, of which the `n` with the highest cumulative logprob
are answered (`best_samples`). This module owns turning request fields into `SamplingParams`, accumulating each
sample's deltas (`Sample`, which also adds each to the server's `TokenTally`), waiting for them
while watching for a client that went away, merging their deltas in arrival order for streaming,
and aborting whatever has not finished when the HTTP request ends early, so the engine frees
their caches.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from starlette.requests import Request

from deltaspec.engine.async_engine import SHUTDOWN_ERROR, AsyncEngine, EngineStopping, RequestDelta, RequestStream
from deltaspec.errors import DeltaspecError, request_error_message
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.vision.prompt import PromptImages
from deltaspec.sample.params import SamplingParams, StructuredOutputsParams
from deltaspec.server.errors import APIError
from deltaspec.server.metrics import TokenTally
from deltaspec.server.protocol import PromptTokensDetails, SamplingFields, UsageInfo

DISCONNECT_POLL_S = 0.1


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def candidates(req: SamplingFields) -> int:
    """How many samples a request runs per prompt: `best_of` when given, else `n`."""
    return req.best_of or req.n


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    defaults: dict[str, float | int],
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine parameters of one sample (n = 1): the request's fields, and for the ones it leaves unset the
    model's `defaults` (its generation config), else vLLM's; `structured` constrains the output; a bad value is a
    400 naming the field. Samples that `best_of` ranks carry their tokens' logprobs."""
    unset = {name: defaults[name] for name in MODEL_DEFAULT_FIELDS if getattr(req, name) is None and name in defaults}
    given = {name: getattr(req, name) for name in MODEL_DEFAULT_FIELDS if getattr(req, name) is not None}
    ranked = candidates(req) > req.n
    try:
        params = SamplingParams(
            n=1,
            **unset,
            **given,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs=0 if logprobs is None and ranked else logprobs,
            prompt_logprobs=req.prompt_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured,
        )
    except DeltaspecError as exc:
        raise APIError(400, str(exc)) from None
    if ranked and params.greedy:
        raise APIError(
            400,
            f"best_of={req.best_of} needs sampling, since greedy samples are all the same; send a temperature above 0 "
            "or leave best_of out.",
            param="best_of",
        )
    return params


@dataclass
class Sample:
    """One engine request of an HTTP request, and everything its deltas have brought so far."""

    index: int
    request_id: str
    stream: RequestStream
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list | None = None  # with the first delta, when asked for
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    tally: TokenTally | None = None  # the server's token counts, which every delta adds to

    def apply(self, delta: RequestDelta) -> None:
        if self.tally is not None:
            self.tally.add(delta, started=bool(self.token_ids))
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finished = True
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.stop_text, self.error, self.metrics = delta.stop_text, delta.error, delta.metrics

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the logprobs of the tokens it sampled (each logprob entry has the sampled token first)."""
        return sum(next(iter(entry.values())).logprob for entry in self.logprobs)

    def text(self, tokenizer: Tokenizer) -> str:
        """The whole output text: the engine's cut text when a stop string ended it, else the decode."""
        if self.stop_text is not None:
            return self.stop_text
        return tokenizer.decode(self.token_ids, self.params.skip_special_tokens)


def submit(
    engine: AsyncEngine,
    request_id: str,
    prompt: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    n: int,
    first_index: int = 0,
    history_len: int = 0,
    images: PromptImages | None = None,
) -> list[Sample]:
    """Queue `n` samples of one prompt; choice indices start at `first_index`; `history_len` prompt tokens are a
    chat's history, which the next turn will share; `images`: the prompt's, encoded. DeltaspecError -> 400."""
    samples: list[Sample] = []
    try:
        for i in range(n):
            index = first_index + i
            sample_params = params if params.seed is None else replace(params, seed=params.seed + i)
            sample_id = f"{request_id}-{index}"
            stream = engine.add_request(sample_id, prompt, prompt_ids, sample_params, history_len, images=images)
            samples.append(Sample(index, sample_id, stream, sample_params, len(prompt_ids)))
    except EngineStopping as exc:
        abort_unfinished(engine, samples)
        raise APIError(503, str(exc)) from None
    except DeltaspecError as exc:
        abort_unfinished(engine, samples)
        raise APIError(400, str(exc)) from None
    return samples


def best_samples(samples: list[Sample], n: int) -> list[Sample]:
    """The `n` samples of one prompt with the highest cumulative logprob, best first (vLLM's `best_of`)."""
    return sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


def abort_unfinished(engine: AsyncEngine, samples: list[Sample]) -> None:
    for sample in samples:
        if not sample.finished:
            engine.abort(sample.request_id)


def engine_error(samples: list[Sample]) -> APIError | None:
    """The error of the first sample the engine failed on (a 503 when shutdown ended it, a 400 when the request
    caused it, as a constraint that gave out while generating; else a 500), or None."""
    failed = next((s for s in samples if s.finish_reason == "error"), None)
    if failed is None:
        return None
    if failed.error == SHUTDOWN_ERROR:
        return APIError(503, SHUTDOWN_ERROR)
    if (message := request_error_message(failed.error)) is not None:
        return APIError(400, message)
    return APIError(500, f"The engine failed while generating this request ({failed.error}).")


async def _drain(sample: Sample, on_delta: Callable[[Sample, RequestDelta], None] | None) -> Sample:
    async for delta in sample.stream:
        sample.apply(delta)
        if on_delta is not None:
            on_delta(sample, delta)
    return sample


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def collect(
    samples: list[Sample],
    request: Request | None,
    on_finished: Callable[[Sample], None] | None = None,
    on_delta: Callable[[Sample, RequestDelta], None] | None = None,
) -> None:
    """Wait until every sample has finished, calling `on_delta` after each delta a sample gets and `on_finished` in
    finishing order.

    Raises ClientDisconnected when `request`'s client goes away first; the caller aborts.
    """
    pending = {asyncio.ensure_future(_drain(s, on_delta)) for s in samples}
    watcher = asyncio.ensure_future(_wait_for_disconnect(request)) if request is not None else None
    try:
        while pending:
            waiting = pending | {watcher} if watcher is not None else pending
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientDisconnected
            for task in done:
                pending.discard(task)
                if on_finished is not None:
                    on_finished(task.result())
    finally:
        for task in [*pending, watcher]:
            if task is not None:
                task.cancel()


async def merged(samples: list[Sample]) -> AsyncIterator[tuple[Sample, RequestDelta]]:
    """Every sample's deltas in arrival order, each applied to its sample before it is yielded."""
    queue: asyncio.Queue[tuple[Sample, RequestDelta]] = asyncio.Queue()

    async def pump(sample: Sample) -> None:
        async for delta in sample.stream:
            queue.put_nowait((sample, delta))

    tasks = [asyncio.ensure_future(pump(s)) for s in samples if not s.finished]
    try:
        remaining = len(tasks)
        while remaining:
            sample, delta = await queue.get()
            sample.apply(delta)
            remaining -= delta.finished
            yield sample, delta
    finally:
        for task in tasks:
            task.cancel()


def usage_of(prompt_tokens: int, samples: list[Sample]) -> UsageInfo:
    """OpenAI usage of a request: its prompt tokens (of which `cached_tokens` resumed from a prefix checkpoint)
    and the tokens of all its samples."""
    completion = sum(len(s.token_ids) for s in samples)
    cached = max((s.metrics.get("num_cached_tokens", 0) for s in samples), default=0)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
