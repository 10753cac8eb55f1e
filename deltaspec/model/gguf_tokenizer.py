"""A deltaspec `Tokenizer` built from a GGUF file's tokenizer metadata alone.

Owns rebuilding a Hugging Face `tokenizers` tokenizer from llama.cpp's `tokenizer.ggml.*` keys for byte-level
BPE vocabularies (`tokenizer.ggml.model` "gpt2") with the Qwen pre-tokenizers: the vocabulary and merges, the
added tokens (CONTROL tokens are special, USER_DEFINED ones are not, UNUSED padding entries are left out), the
pre-tokenizer regex that llama.cpp's `tokenizer.ggml.pre` name stands for (src/llama-vocab.cpp; the regexes are
the original tokenizer.json ones, which llama.cpp rewrites without `(?i:)`), Qwen's NFC normalizer, BOS/EOS
insertion (`add_bos_token` / `add_eos_token`), the special tokens and end-of-sequence ids, and the chat
templates (`tokenizer.chat_template`, `tokenizer.chat_template.<name>`).
"""

from __future__ import annotations

import json

import tokenizers

from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_raw import RawGGUF
from deltaspec.model.tokenizer import Tokenizer

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType
SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}
END_TOKENS = ("eos", "eot", "eom")


def tokenizer_from_gguf(raw: RawGGUF) -> Tokenizer | None:
    """The tokenizer `raw` describes, or None when it has no tokenizer metadata."""
    meta = raw.metadata
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise DeltaspecError(
            f"{raw.path} has a {model!r} tokenizer with the {pre!r} pre-tokenizer; deltaspec rebuilds byte-level "
            f"BPE ('gpt2') tokenizers with the pre-tokenizers {', '.join(PRE_TOKENIZERS)}."
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise DeltaspecError(f"{raw.path} lists {len(tokens)} tokens but {len(types)} token types; it is corrupt.")
    backend = _backend(raw, tokens, types, PRE_TOKENIZERS[pre])
    special_tokens = {
        key: tokens[token_id]
        for key, token in SPECIAL_TOKENS.items()
        if (token_id := _token_id(raw, token, len(tokens))) is not None
    }
    end_ids = {token_id for token in END_TOKENS if (token_id := _token_id(raw, token, len(tokens))) is not None}
    return Tokenizer(
        backend,
        source=str(raw.path),
        special_tokens=special_tokens,
        eos_token_ids=frozenset(end_ids),
        chat_templates=_chat_templates(raw),
    )


def _token_id(raw: RawGGUF, token: str, vocab_size: int) -> int | None:
    """`tokenizer.ggml.<token>_token_id`, when present and inside the vocabulary."""
    token_id = raw.metadata.get(f"tokenizer.ggml.{token}_token_id")
    if token_id is None:
        return None
    if not 0 <= token_id < vocab_size:
        raise DeltaspecError(f"{raw.path} names token {token_id} as its {token} token, outside its vocabulary.")
    return int(token_id)


def _backend(raw: RawGGUF, tokens: list[str], types: list[int], split: str) -> tokenizers.Tokenizer:
    """The `tokenizers` tokenizer, built as a tokenizer.json document so every id stays where the file put it."""
    merges = []
    for merge in raw.metadata.get("tokenizer.ggml.merges") or []:
        left, space, right = merge.partition(" ")
        if not space:
            raise DeltaspecError(f"{raw.path} has a malformed BPE merge {merge!r}.")
        merges.append([left, right])
    vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind in (NORMAL, UNKNOWN, BYTE)}
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types))
        if kind in (CONTROL, USER_DEFINED)
    ]
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": _post_processor(raw, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(document))
    except Exception as exc:  # noqa: BLE001 - tokenizers reports a bad vocabulary with its own exception type
        raise DeltaspecError(f"The tokenizer metadata of {raw.path} does not make a valid tokenizer ({exc}).") from None


def _post_processor(raw: RawGGUF, tokens: list[str]) -> dict | None:
    """BOS / EOS added around each text when `add_bos_token` / `add_eos_token` say so (None: nothing added)."""
    ends = {}
    for token in ("bos", "eos"):
        token_id = _token_id(raw, token, len(tokens))
        if raw.metadata.get(f"tokenizer.ggml.add_{token}_token") and token_id is not None:
            ends[token] = (tokens[token_id], token_id)
    if not ends:
        return None
    first = [{"SpecialToken": {"id": ends["bos"][0], "type_id": 0}}] if "bos" in ends else []
    last = [{"SpecialToken": {"id": ends["eos"][0], "type_id": 0}}] if "eos" in ends else []

    def sequence(type_id: int) -> list[dict]:
        return [*first, {"Sequence": {"id": "AB"[type_id], "type_id": type_id}}, *last]

    return {
        "type": "TemplateProcessing",
        "single": sequence(0),
        "pair": sequence(0) + sequence(1),
        "special_tokens": {
            token: {"id": token, "ids": [token_id], "tokens": [token]} for token, token_id in ends.values()
        },
    }


def _chat_templates(raw: RawGGUF) -> dict[str, str]:
    """Named chat templates: `tokenizer.chat_template` is "default", `tokenizer.chat_template.<name>` the rest."""
    templates = {}
    for key, value in raw.metadata.items():
        if key == "tokenizer.chat_template":
            templates["default"] = value
        elif key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    return templates
