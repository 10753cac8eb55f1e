"""Request results in vLLM's shape: `RequestOutput` with one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaspec.sample.logprobs import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" (eos, stop token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: dict = field(default_factory=dict)
