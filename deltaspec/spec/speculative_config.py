"""vLLM's speculative config, as the `--speculative-config` JSON or `LLM(speculative_config={...})`, read as
deltaspec's `speculative`, `draft_model`, `draft_tokens`, `prompt_lookup_min` and `prompt_lookup_max`.

Methods: ngram, mtp (and vLLM's model-specific MTP names such as qwen3_next_mtp), draft_model (or draft), dflash
(or block: a block drafter, whose directory is `model`), and deltaspec's own mtp+ngram, draft+ngram and
block+ngram; without a method, a `model` means draft_model, as in vLLM. `prompt_lookup_min` / `prompt_lookup_max`
bound the n-gram drafter's match as in vLLM (one of them given: the other takes its value, unless set apart);
they need a method that runs the n-gram drafter. Keys deltaspec cannot honour are refused rather than ignored.
"""

from __future__ import annotations

import json

from deltaspec.errors import DeltaspecError
from deltaspec.spec.factory import CHOICES, uses

EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 5}'
LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
KEYS = ("method", "model", "num_speculative_tokens", *LOOKUP_KEYS)
METHODS = "ngram, mtp (or a vLLM *_mtp name), draft_model, dflash, mtp+ngram, draft+ngram or block+ngram"
SPECULATIVE_CONFIG_HELP = (
    f"vLLM's speculative config as JSON, e.g. '{EXAMPLE}': method ({METHODS}), model (the draft model), "
    "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max; the same as --speculative, --draft-model, "
    "--draft-tokens, --prompt-lookup-min and --prompt-lookup-max"
)


def _method(method: object, where: str) -> str:
    if isinstance(method, str):
        if method in CHOICES:
            return method
        if method == "draft_model":
            return "draft"
        if method == "dflash":
            return "block"
        if "mtp" in method:
            return "mtp"
    raise DeltaspecError(f"{where} has method {method!r}, which deltaspec does not run; use {METHODS}.")


def parse_speculative_json(text: str) -> dict:
    """The `--speculative-config` flag's JSON object."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DeltaspecError(
            f"--speculative-config is not valid JSON ({exc.msg} at character {exc.pos}); give an object such as "
            f"'{EXAMPLE}'."
        ) from None
    if not isinstance(raw, dict):
        raise DeltaspecError(f"--speculative-config must be a JSON object such as '{EXAMPLE}', got {text!r}.")
    return raw


def _count(raw: dict, key: str, where: str) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DeltaspecError(f"{where}'s {key} must be an integer of at least 1, got {value!r}.")
    return value


def _lookup_bounds(raw: dict, given: dict, where: str) -> dict:
    """prompt_lookup_min / prompt_lookup_max as vLLM completes them: one given, the other takes its value (unless
    `given` sets it apart)."""
    bounds = {key: _count(raw, key, where) for key in LOOKUP_KEYS if key in raw}
    if len(bounds) == 1:
        (value,) = bounds.values()
        for key in LOOKUP_KEYS:
            bounds.setdefault(key, given.get(key, value))
    return bounds


def speculative_fields(raw: dict, given: dict, where: str = "--speculative-config") -> dict:
    """The EngineConfig fields the speculative config `raw` sets; `given` are the fields set otherwise (flags, or
    LLM's keyword arguments), which must agree. `where` names the config in messages: "--speculative-config" (the
    fields then named as flags) or "speculative_config"."""
    if unknown := sorted(set(raw) - set(KEYS)):
        raise DeltaspecError(f"{where} has unknown key(s) {', '.join(unknown)}; known keys: {', '.join(KEYS)}.")
    if raw.get("method") is None and raw.get("model") is None:
        raise DeltaspecError(f"{where} needs a method: {METHODS}.")
    chosen = {"speculative": _method(raw["method"], where) if raw.get("method") is not None else "draft"}
    if "model" in raw:
        if not isinstance(raw["model"], str) or not raw["model"]:
            raise DeltaspecError(f"{where}'s model must be a directory or hub id, got {raw['model']!r}.")
        if not uses(chosen["speculative"], "draft") and not uses(chosen["speculative"], "block"):
            raise DeltaspecError(
                f"{where} gives a model, which method {raw['method']!r} does not use; drop it, or use method "
                "draft_model or dflash."
            )
        chosen["draft_model"] = raw["model"]
    if "num_speculative_tokens" in raw:
        chosen["draft_tokens"] = _count(raw, "num_speculative_tokens", where)
    if bounds := _lookup_bounds(raw, given, where):
        if not uses(chosen["speculative"], "ngram"):
            raise DeltaspecError(
                f"{where}'s prompt_lookup_min / prompt_lookup_max bound the n-gram drafter, which method "
                f"{raw['method']!r} does not run; drop them, or use method ngram or mtp+ngram."
            )
        chosen.update(bounds)
    for name, value in chosen.items():
        if name in given and given[name] != value:
            spelled = "--" + name.replace("_", "-") if where.startswith("--") else name
            raise DeltaspecError(
                f"{where} sets {spelled} {value!r} but {spelled} {given[name]!r} was given too; give one of them."
            )
    return chosen
