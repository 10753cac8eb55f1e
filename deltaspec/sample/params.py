"""Per-request sampling parameters: vLLM's names and defaults, normalised and validated when built.

This module owns `SamplingParams` and the rules for what a valid request is, with vLLM's ranges
(`SamplingParams._verify_args`): temperature in [0, 2], top_p in (0, 1], top_k 0 or -1 (off) or at least 1,
min_p in [0, 1], presence and frequency penalties in [-2, 2], max_tokens at least 1, 64-bit seeds, and, needing
the model (`check_token_ids`), top_k and stop_token_ids within the vocabulary. Where vLLM takes any positive
repetition_penalty, this one stays in [0.01, 100]: dividing logits by less overflows them (vLLM clamps a
temperature below 0.01 for the same reason). A bad value raises `DeltaspecError` with one sentence naming the
field, the value and the valid range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaspec.errors import DeltaspecError

GREEDY_EPS = 1e-5
"""A temperature below this is greedy decoding (vLLM's `_SAMPLING_EPS`)."""

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_TEMPERATURE = 2.0  # vLLM's and OpenAI's
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise DeltaspecError(f"{field} must be {rule}, got {_shown(value)}.")


def _shown(value: object) -> str:
    """A value for an error message: its repr, cut to about 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_token_ids(vocab_size: int, top_k: int | None = None, stop_token_ids: list[int] | None = None) -> None:
    """The rules that need the model: top_k at most the vocabulary's size, stop_token_ids inside the vocabulary."""
    _require(
        top_k is None or top_k <= vocab_size,
        "top_k",
        f"0 or -1 (off) or an integer from 1 to {vocab_size} (the vocabulary's size)",
        top_k,
    )
    outside = next((t for t in stop_token_ids or () if not 0 <= t < vocab_size), None)
    _require(outside is None, "stop_token_ids", f"token ids in [0, {vocab_size}) (the vocabulary)", outside)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must be (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema (`json`, a
    dict or its JSON text), any JSON object (`json_object`), a regular expression (`regex`, Rust regex syntax),
    one of some strings (`choice`), or a Lark grammar (`grammar`, llguidance's dialect)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise DeltaspecError(
                "structured_outputs must set exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(given) or 'none'}."
            )
        _require(
            isinstance(self.json_object, bool), "structured_outputs.json_object", "true or false", self.json_object
        )
        _require(
            self.json is None or isinstance(self.json, (dict, str)),
            "structured_outputs.json",
            "a JSON schema (an object or its JSON text)",
            self.json,
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, str) and value != ""),
                f"structured_outputs.{name}",
                "a non-empty string",
                value,
            )
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice)
            _require(bool(ok), "structured_outputs.choice", "a non-empty list of strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop; see vLLM's `SamplingParams`."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (deltaspec.sample.structured)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"a number in [0, {MAX_TEMPERATURE:g}] (0: greedy)",
            self.temperature,
        )
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            "an integer >= 0 (or -1 to disable it)",
            self.top_k,
        )
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an integer between 0 and max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        stop_ok = (
            self.stop is None
            or (isinstance(self.stop, str) and self.stop != "")
            or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s != "" for s in self.stop))
        )
        _require(stop_ok, "stop", "a non-empty string or a list of non-empty strings", self.stop)
        ids_ok = self.stop_token_ids is None or (
            isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
        )
        _require(ids_ok, "stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)
        _require(
            self.seed is None or (_is_int(self.seed) and _INT64_MIN <= self.seed <= _INT64_MAX),
            "seed",
            "a 64-bit signed integer or None",
            self.seed,
        )
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _require(
                value is None or (_is_int(value) and value >= 0),
                field,
                "an integer >= 0 or None",
                value,
            )
        low, high = REPETITION_PENALTY_RANGE
        _require(
            _is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
            "repetition_penalty",
            f"a number in [{low:g}, {high:g}] (1: off)",
            self.repetition_penalty,
        )
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            _require(_is_number(value) and -2 <= value <= 2, field, "in [-2, 2]", value)
        for field in ("skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, field)
            _require(isinstance(value, bool), field, "true or false", value)
        _require(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "a StructuredOutputsParams or None",
            self.structured_outputs,
        )

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy: temperature 0, or below `GREEDY_EPS` as in vLLM."""
        return self.temperature < GREEDY_EPS
