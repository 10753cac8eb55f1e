"""vLLM's `--speculative-config` JSON, read as deltaspec's `--speculative`, `--draft-tokens` and `--draft-model`.

Methods: ngram, mtp (and vLLM's model-specific MTP names such as qwen3_next_mtp), draft_model (or draft), dflash
(or block: a block drafter, whose directory is `model`), and deltaspec's own mtp+ngram, draft+ngram and
block+ngram; without a method, a `model` means draft_model, as in vLLM. Keys
deltaspec cannot honour (vLLM's prompt_lookup_min/max set the n-gram sizes, which deltaspec fixes at 2 to 5)
are refused rather than ignored.
"""

from __future__ import annotations

import json

from deltaspec.errors import DeltaspecError

EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5}'
KEYS = ("method", "model", "num_speculative_tokens")
FLAGS = {"speculative": "--speculative", "draft_model": "--draft-model", "draft_tokens": "--draft-tokens"}
METHODS = "ngram, mtp (or a vLLM *_mtp name), draft_model, dflash, mtp+ngram, draft+ngram or block+ngram"
SPECULATIVE_CONFIG_HELP = (
    f"vLLM's speculative config as JSON, e.g. '{EXAMPLE}': method ({METHODS}), model (the draft model), "
    "num_speculative_tokens; the same as --speculative, --draft-model and --draft-tokens"
)


def _method(method: object) -> str:
    from deltaspec.spec.factory import CHOICES

    if isinstance(method, str):
        if method in CHOICES:
            return method
        if method == "draft_model":
            return "draft"
        if method == "dflash":
            return "block"
        if "mtp" in method:
            return "mtp"
    raise DeltaspecError(f"--speculative-config has method {method!r}, which deltaspec does not run; use {METHODS}.")


def _parse(text: str) -> dict:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DeltaspecError(
            f"--speculative-config is not valid JSON ({exc.msg} at character {exc.pos}); give an object such as "
            f"'{EXAMPLE}'."
        ) from None
    if not isinstance(raw, dict):
        raise DeltaspecError(f"--speculative-config must be a JSON object such as '{EXAMPLE}', got {text!r}.")
    if unknown := sorted(set(raw) - set(KEYS)):
        lookup = any(key.startswith("prompt_lookup") for key in unknown)
        note = " (deltaspec's n-gram drafter always matches 2 to 5 tokens)" if lookup else ""
        raise DeltaspecError(
            f"--speculative-config has unknown key(s) {', '.join(unknown)}{note}; known keys: {', '.join(KEYS)}."
        )
    return raw


def speculative_fields(text: str, given: dict) -> dict:
    """The EngineConfig fields `text` (the flag's JSON) sets; `given` are the fields set by flags, which must agree."""
    raw = _parse(text)
    if raw.get("method") is None and raw.get("model") is None:
        raise DeltaspecError(f"--speculative-config needs a method: {METHODS}.")
    chosen = {"speculative": _method(raw["method"]) if raw.get("method") is not None else "draft"}
    if "model" in raw:
        if not isinstance(raw["model"], str) or not raw["model"]:
            raise DeltaspecError(f"--speculative-config's model must be a directory or hub id, got {raw['model']!r}.")
        if "draft" not in chosen["speculative"] and "block" not in chosen["speculative"]:
            raise DeltaspecError(
                f"--speculative-config gives a model, which method {raw['method']!r} does not use; drop it, or use "
                "method draft_model or dflash."
            )
        chosen["draft_model"] = raw["model"]
    if "num_speculative_tokens" in raw:
        count = raw["num_speculative_tokens"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise DeltaspecError(
                f"--speculative-config's num_speculative_tokens must be an integer of at least 1, got {count!r}."
            )
        chosen["draft_tokens"] = count
    for name, value in chosen.items():
        if name in given and given[name] != value:
            raise DeltaspecError(
                f"--speculative-config sets {FLAGS[name]} {value!r} but {FLAGS[name]} {given[name]!r} was given too; "
                "give one of them."
            )
    return chosen
