"""Engine logprobs -> the two OpenAI shapes: chat `logprobs.content[]` and completions' parallel lists, and vLLM's
`prompt_logprobs` (per prompt position, the first None: token id -> logprob, rank and decoded token).

Each engine entry is a dict token id -> `Logprob` with the sampled token first, then the most
likely tokens by rank. A top-k list is the entries of rank <= k in rank order. -inf (a token masked
out) becomes -9999.0, as vLLM does, since JSON has no infinities.
"""

from __future__ import annotations

import math

from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.logprobs import Logprob
from deltaspec.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _text(token_id: int, lp: Logprob, tokenizer: Tokenizer) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode_token(token_id)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)


def chat_logprobs(entries: list[dict[int, Logprob]], top_k: int, tokenizer: Tokenizer) -> ChatLogprobs:
    """`choices[].logprobs` of a chat completion (or of one stream chunk)."""
    content = []
    for entry in entries:
        token_id, chosen = next(iter(entry.items()))
        text = _text(token_id, chosen, tokenizer)
        top = [
            TopLogprob(
                token=(t := _text(tid, lp, tokenizer)), logprob=_finite(lp.logprob), bytes=list(t.encode("utf-8"))
            )
            for tid, lp in _top(entry, top_k)
        ]
        content.append(
            ChatTokenLogprob(
                token=text, logprob=_finite(chosen.logprob), bytes=list(text.encode("utf-8")), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: list[dict[int, Logprob]], top_k: int, tokenizer: Tokenizer, offset: int = 0
) -> CompletionLogprobs:
    """`choices[].logprobs` of a completion; `offset` is the text offset of the first token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        token_id, chosen = next(iter(entry.items()))
        text = _text(token_id, chosen, tokenizer)
        tokens.append(text)
        token_logprobs.append(_finite(chosen.logprob))
        top_logprobs.append({_text(t, lp, tokenizer): _finite(lp.logprob) for t, lp in _top(entry, top_k)})
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def prompt_logprobs(entries: list[dict[int, Logprob] | None], tokenizer: Tokenizer) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of one prompt: each position's prompt token and top alternatives, by token id."""
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=_text(token_id, lp, tokenizer)
            )
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]
