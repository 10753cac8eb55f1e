"""Incremental detokenization for streaming: token ids in, text deltas out.

Each call decodes only the tokens since the last resolved point (with the previous step's tokens
as context, as vLLM does), so a step costs the same at token 10 and token 10,000, and the
concatenated deltas equal the whole-text decode. Held back until they resolve: a trailing U+FFFD (a UTF-8 character
whose bytes are split across tokens) and any tail that could be the start of a stop string (the
engine then cuts the text there and reports it as `stop_text`, which `finish` uses).
"""

from __future__ import annotations

from deltaspec.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def stop_hold_start(text: str, stops: list[str], start: int = 0) -> int:
    """Smallest index i >= start such that text[i:] is a proper prefix of some stop string (else len(text))."""
    if not stops:
        return len(text)
    longest = max(len(s) for s in stops)
    for i in range(max(start, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(len(stop) > len(tail) and stop.startswith(tail) for stop in stops):
            return i
    return len(text)


class IncrementalDetokenizer:
    """Text deltas of one sample's output tokens."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.token_ids: list[int] = []
        self.text = ""  # decoded text of token_ids[:read]
        self.prefix = 0  # token_ids[prefix:read] is the context decoded again with new tokens
        self.read = 0
        self.emitted = 0  # characters of `text` already returned

    def _resolve(self, final: bool) -> None:
        """Move new tokens into `text` unless they end inside a UTF-8 character (or `final`)."""
        context = self.tokenizer.decode(self.token_ids[self.prefix : self.read], self.skip_special_tokens)
        extended = self.tokenizer.decode(self.token_ids[self.prefix :], self.skip_special_tokens)
        if final or (len(extended) > len(context) and not extended.endswith(REPLACEMENT)):
            self.text += extended[len(context) :]
            self.prefix, self.read = self.read, len(self.token_ids)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text that is safe to emit now."""
        self.token_ids.extend(new_token_ids)
        self._resolve(final=False)
        end = stop_hold_start(self.text, self.stop, self.emitted)
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def finish(self, new_token_ids: list[int], stop_text: str | None = None) -> str:
        """The rest of the output, given the sample's last tokens; `stop_text` is the engine's cut text, if any.

        The last tokens may complete a stop string, so they go through here rather than `add`.
        """
        self.token_ids.extend(new_token_ids)
        self._resolve(final=True)
        text = stop_text if stop_text is not None else self.text
        delta = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return delta
