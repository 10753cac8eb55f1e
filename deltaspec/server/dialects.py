"""llama-server's spellings of request fields, on every generating endpoint: read as what they mean there, or
refused in one sentence naming what works here.

Read: `n_predict` is `max_tokens` (-1: no limit but the context, llama-server's "infinity"), `repeat_penalty` is
`repetition_penalty` (applied, as vLLM applies it, over the whole prompt and output), `json_schema` is
`guided_json`. A request that gives both spellings with different values is refused; llama-server would quietly
prefer one. Refused unless set to the value that leaves them off: llama-server's samplers this server has not
(`mirostat`, `typical_p`, `tfs_z`, `dry_multiplier`, `xtc_probability`), `repeat_last_n` (llama-server's penalty
looks back 64 tokens by default; here it covers everything, its -1), `n_probs` and `grammar` (GBNF).
"""

from __future__ import annotations

from deltaspec.server.errors import APIError, shown
from deltaspec.server.protocol import SamplingFields

NO_LIMIT = -1  # n_predict: generate until the model ends or the context is full

# llama-server's spelling -> the field it stands for here
ALIASES = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "json_schema": "guided_json"}

# llama-server's fields this server has not: the values that leave them off, and what to send instead
_LLAMA_ONLY = {
    "mirostat": ((0,), "send the request without it"),
    "typical_p": ((1,), "send the request without it"),
    "tfs_z": ((1,), "send the request without it"),
    "dry_multiplier": ((0,), "send the request without it"),
    "xtc_probability": ((0,), "send the request without it"),
    "repeat_last_n": ((-1,), "leave it out, since repeat_penalty here covers the whole prompt and output"),
    "n_probs": ((0,), "use logprobs on /v1/completions"),
    "grammar": ((None, ""), "send a Lark grammar as structured_outputs.grammar, or a JSON schema as json_schema"),
}


def reject_llama_only(data: dict) -> None:
    """400 for a llama-server field this server does not implement, set to anything but its off value (checked on
    the raw body)."""
    for name, (off, instead) in _LLAMA_ONLY.items():
        if name in data and data[name] not in off:
            raise APIError(400, f"{name} (llama-server's) is not supported by this server; {instead}.", param=name)


def _targets(req: SamplingFields, alias: str) -> list[str]:
    """The fields `alias` stands for on this request (n_predict also stands for chat's max_completion_tokens)."""
    target = ALIASES[alias]
    if target == "max_tokens" and "max_completion_tokens" in type(req).model_fields:
        return [target, "max_completion_tokens"]
    return [target]


def resolve_aliases(req: SamplingFields) -> SamplingFields:
    """`req` with llama-server's spellings copied to the fields they stand for (n_predict -1 stays where it is:
    `unlimited` reads it); a 400 when both spellings are given with different values."""
    update = {}
    for alias, target in ALIASES.items():
        value = getattr(req, alias)
        if value is None:
            continue
        for name in _targets(req, alias):
            given = getattr(req, name)
            if given is not None and given != value:
                raise APIError(
                    400,
                    f"{alias} ({shown(value)}) and {name} ({shown(given)}) are two spellings of one setting; give one "
                    "of them.",
                    param=alias,
                )
        if alias == "n_predict":
            if value == NO_LIMIT:
                continue
            if value < 1:
                raise APIError(
                    400, f"n_predict must be at least 1, or -1 for no limit, got {shown(value)}.", param="n_predict"
                )
        update[target] = value
    return req.model_copy(update=update) if update else req


def unlimited(req: SamplingFields) -> bool:
    """Whether the request asks for no token limit but the context (llama-server's `n_predict: -1`)."""
    return req.n_predict == NO_LIMIT
