"""The model's own sampling defaults, read from its `generation_config.json` (or a GGUF file's
`general.sampling.*` metadata, which llama.cpp's converter writes from that file, and the
`deltaspec.sampling.max_tokens` key `deltaspec quantize` adds for `max_new_tokens`, which llama.cpp has no key for).

vLLM applies a checkpoint's generation config to every request that does not set a field itself
(`--generation-config auto`, its default); deltaspec does the same for `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`). An explicit `do_sample: false` means
greedy decoding whatever the temperature, as in transformers' `generate` (vLLM reads the temperature alone).
A value of the wrong type is one sentence naming the file and the field; the ranges are checked where
`SamplingParams` is built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from deltaspec.errors import DeltaspecError

FILE_NAME = "generation_config.json"
SAMPLING_FIELDS = {  # generation_config.json key -> SamplingParams field
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
INTEGER_FIELDS = ("top_k", "max_new_tokens")
GGUF_MAX_TOKENS = "deltaspec.sampling.max_tokens"
GGUF_FIELDS = {  # GGUF metadata key (gguf-py's Keys.General.SAMPLING_*, and deltaspec's) -> SamplingParams field
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    GGUF_MAX_TOKENS: "max_tokens",
}
GGUF_INTEGER_FIELDS = ("general.sampling.top_k", GGUF_MAX_TOKENS)


def _value(path: Path, key: str, value: object, integer: bool) -> float | int:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or (integer and not float(value).is_integer()):
        kind = "an integer" if integer else "a number"
        raise DeltaspecError(f"{path} sets {key} to {value!r}, which is not {kind}; fix or remove that field.")
    return int(value) if integer else float(value)


def sampling_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """The `SamplingParams` fields the checkpoint at `model_dir` sets (empty without a generation config)."""
    if model_dir is None or not (path := Path(model_dir) / FILE_NAME).is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaspecError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint.") from None
    if not isinstance(raw, dict):
        raise DeltaspecError(f"{path} is not a JSON object; restore it from the original checkpoint.")
    defaults = {
        name: _value(path, key, raw[key], key in INTEGER_FIELDS)
        for key, name in SAMPLING_FIELDS.items()
        if raw.get(key) is not None
    }
    if raw.get("do_sample") is False:
        defaults["temperature"] = 0.0  # transformers' generate ignores the temperature then
    return defaults


def gguf_sampling_defaults(path: Path, metadata: dict) -> dict[str, float | int]:
    """The `SamplingParams` fields a GGUF file's `general.sampling.*` keys set. As in llama.cpp, a top_k of 0 or
    less means no top-k cut (deltaspec's 0)."""
    defaults = {}
    for key, name in GGUF_FIELDS.items():
        if metadata.get(key) is not None:
            defaults[name] = _value(path, key, metadata[key], key in GGUF_INTEGER_FIELDS)
    if defaults.get("top_k", 1) < 0:
        defaults["top_k"] = 0
    return defaults
