"""Request rules that pydantic types cannot say: n, vLLM's `best_of` and `prompt_logprobs`, the per-request
sequence cap, `max_tokens`, seeds that stay 64-bit for every sample, token ids within the model's vocabulary
(`top_k`, `stop_token_ids`; the rule is `sample/params.py`'s), and fields that would change what a request means
but are not implemented (`logit_bias`, `suffix`, `functions`; on chat, vLLM's `echo` and `return_token_ids`),
which are refused rather than ignored.
Each broken rule is a 400 naming the field and what would work.
"""

from __future__ import annotations

from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import check_token_ids
from deltaspec.server.errors import APIError, shown
from deltaspec.server.protocol import ChatCompletionRequest, SamplingFields

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Fields that, ignored, would silently give another answer than the one asked for; empty values are accepted.
_NOT_IMPLEMENTED = ("logit_bias", "suffix", "functions")
# vLLM's chat flags this server does not implement; false is accepted.
_CHAT_FLAGS_NOT_IMPLEMENTED = ("echo", "return_token_ids")


def reject_unimplemented(data: dict) -> None:
    """400 for a request field this server does not implement and must not ignore (checked on the raw body)."""
    for name in _NOT_IMPLEMENTED:
        if data.get(name) not in (None, "", [], {}):
            raise APIError(400, f"{name} is not supported by this server; send the request without it.", param=name)


def check_fields(req: SamplingFields, vocab_size: int) -> None:
    """400 for a validated body's token id outside the vocabulary or a chat flag this server does not implement."""
    for name, value in (("top_k", req.top_k), ("stop_token_ids", req.stop_token_ids)):
        try:
            check_token_ids(vocab_size, **{name: value})
        except DeltaspecError as exc:
            raise APIError(400, str(exc), param=name) from None
    if isinstance(req, ChatCompletionRequest):
        for name in _CHAT_FLAGS_NOT_IMPLEMENTED:
            if getattr(req, name):
                raise APIError(
                    400,
                    f"{name} is not supported on /v1/chat/completions; send the request with {name} false.",
                    param=name,
                )


def check_best_of(req: SamplingFields) -> None:
    """best_of (vLLM's: run that many samples, answer the n with the highest cumulative logprob) must be at least
    n, and more than n cannot be streamed nor voted on."""
    best_of = req.best_of
    if best_of is None or best_of == req.n:
        return
    if best_of < req.n:
        raise APIError(400, f"best_of must be at least n ({req.n}), got {shown(best_of)}.", param="best_of")
    if req.stream:
        raise APIError(
            400,
            "best_of greater than n cannot be streamed, since the best samples are known only at the end; send the "
            "request without stream.",
            param="best_of",
        )
    if getattr(req, "vote", False):
        raise APIError(400, "best_of cannot be combined with vote; send one of them.", param="best_of")


def check_prompt_logprobs(req: SamplingFields) -> None:
    """prompt_logprobs (vLLM's: each prompt token's logprob and its top alternatives) is 0 to 20, and not streamed."""
    value = req.prompt_logprobs
    if value is None:
        return
    if value == -1:
        raise APIError(
            400, "prompt_logprobs -1 (the whole vocabulary) is not supported; send 0 to 20.", param="prompt_logprobs"
        )
    if not 0 <= value <= 20:
        raise APIError(400, f"prompt_logprobs must be 0 to 20, got {shown(value)}.", param="prompt_logprobs")
    if req.stream:
        raise APIError(
            400, "prompt_logprobs cannot be streamed; send the request without stream.", param="prompt_logprobs"
        )


def check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise APIError(400, f"{name} must be at least 1, got {shown(value)}.", param=name)


def check_n(n: int, max_n: int, name: str = "n") -> None:
    """`n` (or `best_of`, the samples run per prompt) is 1 to the server's --max-n."""
    if n < 1:
        raise APIError(400, f"{name} must be at least 1, got {shown(n)}.", param=name)
    if n > max_n:
        raise APIError(400, f"{name} must be at most {max_n} on this server, got {shown(n)}.", param=name)


def check_sequences(prompts: int, n: int, limit: int) -> None:
    """400 when `prompts` x `n` exceeds the server's per-request sequence cap."""
    if prompts * n > limit:
        raise APIError(
            400,
            f"This request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences, but this server runs at "
            f"most {limit} per request (--max-sequences-per-request); send fewer prompts or a smaller n.",
            param="n" if prompts == 1 else "prompt",
        )


def check_seed(seed: int | None, n: int) -> None:
    """400 unless the n samples' seeds `seed`, `seed + 1`, ..., `seed + n - 1` all fit in 64 bits."""
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX - (n - 1):
        raise APIError(
            400,
            f"seed must be an integer in [{INT64_MIN}, {INT64_MAX - (n - 1)}] so that the seeds of the n={n} "
            f"samples (seed, seed + 1, ...) fit in 64 bits, got {shown(seed)}.",
            param="seed",
        )
