"""Perplexity and bits per byte of a model on text, measured through the engine itself.

The text is tokenized as one stream and cut into non-overlapping windows of `window` tokens;
each window is scored from its own start (prompt logprobs), so every token but a window's first
is predicted once. Bits per byte divides the total negative log-likelihood (in bits) by the UTF-8
bytes of the predicted tokens' text. The training tools measure held-out quality the same way.
"""

from __future__ import annotations

import math

from deltaspec.errors import DeltaspecError
from deltaspec.llm import LLM
from deltaspec.sample.params import SamplingParams


def perplexity(llm: LLM, text: str, window: int = 1024, max_windows: int | None = None) -> dict:
    """{"tokens", "bytes", "loss", "ppl", "bits_per_byte"} of `llm` on `text`."""
    if llm.tokenizer is None:
        raise DeltaspecError("Perplexity needs a tokenizer, and this checkpoint has none.")
    ids = llm.tokenizer.encode(text)
    windows = [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
    if max_windows is not None:
        windows = windows[:max_windows]
    if not windows:
        raise DeltaspecError("The text is too short to measure; give at least two tokens.")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    nll = tokens = nbytes = 0
    for out, w in zip(outputs, windows):
        nll -= sum(lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], w[1:]))
        tokens += len(w) - 1
        nbytes += len(llm.tokenizer.decode(w[1:], skip_special_tokens=True).encode())
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "loss": nll / tokens,
        "ppl": math.exp(nll / tokens),
        "bits_per_byte": nll / math.log(2) / max(nbytes, 1),
    }
