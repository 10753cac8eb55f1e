"""Split a Qwen3 / Qwen3.5 completion into reasoning and answer (vLLM's `reasoning_content`).

Owns the `<think>` / `</think>` convention, whole-text (`split_reasoning`) and streamed
(`ReasoningStream`), with one rule set so that a stream's concatenated deltas always equal the
whole-text split.

With thinking on, Qwen chat templates end the generation prompt with `<think>\\n`, so the
output starts inside the think block: `reasoning\\n</think>\\n\\nanswer`. With thinking off the
prompt ends with `<think>\\n\\n</think>\\n\\n` and the output is all answer. Rules:

- A `<think>` at the very start of the output (older templates, where the model writes it) is
  dropped and the output is treated as thinking, whatever `started_in_thinking` says.
- Reasoning ends at the first `</think>`, or at the first `<tool_call>` followed (after optional
  whitespace) by `<function=`: Qwen3.5 may open an XML tool call inside its think block without
  closing it, and vLLM's Qwen3 parser treats that as the implicit end of reasoning. The tool call
  then belongs to the content, so a tool-call parser can pick it up.
- Newlines are trimmed the way the Qwen templates trim them when they re-render history:
  reasoning is `strip("\\n")`-ed and content after `</think>` is `lstrip("\\n")`-ed. (vLLM returns
  both untrimmed, e.g. reasoning `"...\\n"` and content `"\\n\\nanswer"`.) Other whitespace and
  non-thinking output are left as they are.
- Thinking that never reaches its end (cut by max_tokens) is all reasoning; content is `""`.
"""

from __future__ import annotations

import enum
import re

THINK_START = "<think>"
THINK_END = "</think>"
_TOOL_CALL = "<tool_call>"
_FUNCTION = "<function="
_IMPLICIT_END = re.compile(r"<tool_call>\s*<function=")


def _reasoning_end(text: str) -> tuple[int, int] | None:
    """(where reasoning stops, where content starts) for the earliest end marker, or None."""
    end = text.find(THINK_END)
    match = _IMPLICIT_END.search(text)
    if match is not None and (end < 0 or match.start() < end):
        return match.start(), match.start()
    if end >= 0:
        return end, end + len(THINK_END)
    return None


def _may_become_end(tail: str) -> bool:
    """Whether `tail` (no complete end marker in it) could grow into one."""
    if THINK_END.startswith(tail) or _TOOL_CALL.startswith(tail):
        return True
    return tail.startswith(_TOOL_CALL) and _FUNCTION.startswith(tail[len(_TOOL_CALL) :].lstrip())


def _hold_from(text: str) -> int:
    """Index from which `text` must be held back because an end marker may start there."""
    for i, char in enumerate(text):
        if char == "<" and _may_become_end(text[i:]):
            return i
    return len(text)


def split_reasoning(text: str, started_in_thinking: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a whole completion; reasoning is None when it did not think."""
    thinking = started_in_thinking
    if text.startswith(THINK_START):
        text = text[len(THINK_START) :]
        thinking = True
    if not thinking:
        return None, text
    found = _reasoning_end(text)
    if found is None:
        return text.strip("\n"), ""
    return text[: found[0]].strip("\n"), text[found[1] :].lstrip("\n")


class _Phase(enum.Enum):
    START = enum.auto()  # waiting to see whether the output opens with <think>
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningStream:
    """Incremental `split_reasoning`: feed text deltas, get (reasoning_delta, content_delta).

    Text that may be the beginning of a tag split across deltas (`</thi`, `<tool_call>\\n<fu`,
    a trailing newline of the reasoning) is held back until the next delta or `flush()`.
    """

    def __init__(self, started_in_thinking: bool) -> None:
        self._thinking = started_in_thinking
        self._phase = _Phase.START
        self._buf = ""
        self._reasoning_started = False  # a non-newline reasoning character was emitted
        self._held_newlines = ""  # trailing reasoning newlines, emitted only if text follows
        self._after_end = False  # content follows an end marker and has no character yet

    def feed(self, delta: str) -> tuple[str, str]:
        """Add the next piece of generated text; return what can be emitted now."""
        self._buf += delta
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        """End of generation: return everything still held back."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase is _Phase.START:
            if not final and len(self._buf) < len(THINK_START) and THINK_START.startswith(self._buf):
                return "", ""
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START) :]
                self._thinking = True
            self._phase = _Phase.REASONING if self._thinking else _Phase.CONTENT
        if self._phase is _Phase.REASONING:
            found = _reasoning_end(self._buf)
            if found is not None:
                reasoning, self._buf = self._buf[: found[0]], self._buf[found[1] :]
                self._phase = _Phase.CONTENT
                self._after_end = True
            else:
                cut = len(self._buf) if final else _hold_from(self._buf)
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
            reasoning = self._trim_reasoning(reasoning)
        if self._phase is _Phase.CONTENT:
            content, self._buf = self._buf, ""
            if self._after_end:
                content = content.lstrip("\n")
                self._after_end = not content
        return reasoning, content

    def _trim_reasoning(self, text: str) -> str:
        """Streamed `strip("\\n")`: drop leading newlines, hold trailing ones until text follows.

        Held newlines are dropped for good when reasoning ends, since nothing calls this again.
        """
        if not self._reasoning_started:
            text = text.lstrip("\n")
        text = self._held_newlines + text
        body = text.rstrip("\n")
        self._held_newlines = text[len(body) :]
        if body:
            self._reasoning_started = True
        return body
