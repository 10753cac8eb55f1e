"""The tokenizer of a random-weight GGUF file: the smallest byte-level BPE vocabulary llama.cpp loads, padded to the
shape's vocabulary size.

Owns its `tokenizer.ggml.*` keys, with the types and order the converter's `_set_vocab_gpt2` gives them: model
"gpt2" with Qwen's pre-tokenizer (`qwen35`, or `qwen2` for Qwen3-Next, as their real files name it), the 256 byte
tokens in GPT-2's byte-to-unicode spelling (so any text tokenizes, byte by byte), one merge (two spaces) and its
token, because llama.cpp requires a merge list and gguf-py writes no empty array, Qwen's three control tokens
(`<|endoftext|>` as BOS and padding, `<|im_end|>` as EOS), and `[PAD{i}]` UNUSED entries up to the vocabulary
size, as the converter pads a vocabulary shorter than the embedding table. llama.cpp's loader
(src/llama-vocab.cpp `llama_vocab::impl::load`) needs every token text to be distinct and a merges array; deltaspec
rebuilds the same tokenizer from these keys (`gguf_tokenizer`).
"""

from __future__ import annotations

import gguf

from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_write_meta import CONTROL, NORMAL, UNUSED

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGE = ("\u0120", "\u0120")  # "Ġ Ġ": two spaces
PRE_TOKENIZER = {"qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3next": "qwen2"}


def byte_tokens() -> list[str]:
    """GPT-2's `bytes_to_unicode`: the printable byte of each value as itself, the others as U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def minimal_vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
    """The tokens and token types of the vocabulary (see the module docstring)."""
    tokens = [*byte_tokens(), "".join(MERGE), *CONTROL_TOKENS]
    if vocab_size < len(tokens):
        raise DeltaspecError(f"A vocabulary of {vocab_size} tokens is too small; a GGUF tokenizer needs {len(tokens)}.")
    types = [NORMAL] * (len(tokens) - len(CONTROL_TOKENS)) + [CONTROL] * len(CONTROL_TOKENS)
    padding = range(len(tokens), vocab_size)
    return tokens + [f"[PAD{i}]" for i in padding], types + [UNUSED] * len(padding)


def add_minimal_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The tokenizer keys of a random-weight file of `writer.arch` with `vocab_size` tokens."""
    tokens, types = minimal_vocabulary(vocab_size)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", PRE_TOKENIZER[writer.arch])
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", [" ".join(MERGE)])
    end_of_text, _, im_end = (tokens.index(t) for t in CONTROL_TOKENS)
    writer.add_uint32("tokenizer.ggml.eos_token_id", im_end)
    writer.add_uint32("tokenizer.ggml.padding_token_id", end_of_text)
    writer.add_uint32("tokenizer.ggml.bos_token_id", end_of_text)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
