"""The key/value metadata of a GGUF file, as llama.cpp's converter writes it for qwen35, qwen35moe and qwen3next.

Owns, in the converter's order and value types (conversion/base.py `prepare_metadata`, `TextModel.
set_gguf_parameters`, `_set_vocab_gpt2`, `get_vocab_base`; conversion/qwen.py `Qwen2MoeModel`, `_QwenMtpMixin`,
`Qwen3NextModel`, `_Qwen35MRopeMixin`): `general.*` (gguf-py's own `Metadata` heuristics for the name, and the
size label from the tensors), the architecture's hyperparameters from config.json (its `text_config` merged into
the root, as the converter reads it), `general.quantization_version`, and the tokenizer: `tokenizer.ggml.*` from
tokenizer.json (every id below the model's vocabulary size, `[PAD{i}]` UNUSED entries for the gaps, added tokens
CONTROL when special or `<|...|>`-shaped, else USER_DEFINED, taken as written: the converter's re-encoding of
un-normalized added tokens leaves Qwen's unchanged), the pre-tokenizer name, and gguf-py's
`SpecialVocab` (merges, special token ids, add_bos/eos flags, chat template).

The pre-tokenizer name is the converter's: the SHA-256 of the check text's token ids, for the Qwen hashes llama.cpp
knows; a tokenizer it does not know is named by its split regex when that is exactly Qwen2's or Qwen3.5's (what
the name stands for in llama.cpp), and refused otherwise. Keys are written by name, not with GGUFWriter's
per-key helpers, so that any gguf >= 0.17 writes the same file.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf
import tokenizers

from deltaspec.errors import DeltaspecError
from deltaspec.model.generation_config import GGUF_MAX_TOKENS, sampling_defaults
from deltaspec.model.gguf_tokenizer import PRE_TOKENIZERS

# conversion/base.py get_vocab_base_pre: the check text and the hashes of its ids that name a Qwen pre-tokenizer
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_HASHES = {
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen3.5-9B-Instruct
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",  # MiniCPM-V-4_6
}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType
GGML_QUANT_VERSION = 2
DEFAULT_MROPE_SECTIONS = [11, 11, 10, 0]  # _Qwen35MRopeMixin


def add_general(writer: gguf.GGUFWriter, model_dir: Path | None, name: str | None) -> None:
    """`general.type`, then what gguf-py's `Metadata` finds (the name from the directory or `name`, the model
    card's fields, the sampling defaults of generation_config.json) and the size label of the tensors already added
    to `writer` (`prepare_metadata`), with `repetition_penalty` as `general.sampling.penalty_repeat` where the
    installed gguf-py reads only `penalty_repeat` (llama.cpp's own gguf-py reads both), then the generation
    defaults the converter drops: `do_sample: false` as `general.sampling.temp` 0 (where the converter would write
    the temperature, which greedy decoding ignores; llama.cpp samples greedily at 0 too), and `max_new_tokens` as
    `deltaspec.sampling.max_tokens`."""
    total, shared, expert, experts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, model_dir, name, total)
    if metadata.name is None:
        metadata.name = model_dir.name if model_dir is not None else "model"
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, experts)
    defaults = sampling_defaults(model_dir)
    if metadata.sampling_penalty_repeat is None and "repetition_penalty" in defaults:
        metadata.sampling_penalty_repeat = defaults["repetition_penalty"]
    if defaults.get("temperature") == 0.0:
        metadata.sampling_temp = 0.0
    writer.add_string("general.type", "model")
    metadata.set_gguf_meta_model(writer)
    if "max_tokens" in defaults:
        writer.add_uint32(GGUF_MAX_TOKENS, defaults["max_tokens"])


SAMPLING_INTEGERS = ("general.sampling.top_k", "general.sampling.penalty_last_n", "general.sampling.mirostat")


def add_gguf_sampling(writer: gguf.GGUFWriter, metadata: dict[str, Any]) -> None:
    """The `general.sampling.*` keys of a GGUF file's metadata (the model's sampling defaults), with the value
    types gguf-py's writer gives them, as llama-quantize keeps them, and deltaspec's `max_tokens` key."""
    for key, value in metadata.items():
        if key == GGUF_MAX_TOKENS:
            writer.add_uint32(key, int(value))
        elif not key.startswith("general.sampling."):
            continue
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key in SAMPLING_INTEGERS:
            writer.add_int32(key, int(value))
        else:
            writer.add_float32(key, float(value))


def first(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """`find_hparam(keys, optional=True)`: the value of the first key present, else None."""
    return next((hparams[k] for k in keys if k in hparams), None)


def add_hyperparameters(writer: gguf.GGUFWriter, hparams: dict[str, Any], num_mtp: int, file_type: int) -> None:
    """`set_gguf_parameters` of the converter's Qwen3.5 / Qwen3-Next classes, base class first."""
    arch = writer.arch

    def u32(key: str, value: Any) -> None:
        if value is not None:
            writer.add_uint32(f"{arch}.{key}", int(value))

    n_layers = hparams["num_hidden_layers"]
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and key in hparams:
            rope[key] = hparams[key]
    u32("block_count", n_layers + num_mtp)
    ctx_keys = ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length")
    u32("context_length", first(hparams, ctx_keys + ("model_max_length",)))
    u32("embedding_length", first(hparams, ("hidden_size", "n_embd", "dim")))
    ff_keys = ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner")
    u32("feed_forward_length", first(hparams, ff_keys + ("hidden_dim",)))
    u32("attention.head_count", first(hparams, ("num_attention_heads", "n_head", "n_heads")))
    u32("attention.head_count_kv", first(hparams, ("num_key_value_heads", "n_kv_heads")))
    if "mrope_section" in rope:
        writer.add_array(f"{arch}.rope.dimension_sections", (list(rope["mrope_section"]) + [0] * 4)[:4])
    if rope.get("rope_theta") is not None:
        writer.add_float32(f"{arch}.rope.freq_base", float(rope["rope_theta"]))
    if (eps := first(hparams, ("rms_norm_eps", "norm_eps"))) is not None:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(eps))
    u32("expert_count", first(hparams, ("num_local_experts", "num_experts", "n_routed_experts")))
    u32("expert_used_count", first(hparams, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")))
    u32("attention.key_length", hparams.get("head_dim"))
    u32("attention.value_length", hparams.get("head_dim"))
    writer.add_uint32("general.file_type", file_type)
    u32("expert_feed_forward_length", hparams.get("moe_intermediate_size"))
    u32("expert_shared_feed_forward_length", hparams.get("shared_expert_intermediate_size"))
    if num_mtp:
        u32("nextn_predict_layers", num_mtp)
    u32("ssm.conv_kernel", hparams["linear_conv_kernel_dim"])
    u32("ssm.state_size", hparams["linear_key_head_dim"])
    u32("ssm.group_count", hparams["linear_num_key_heads"])
    u32("ssm.time_step_rank", hparams["linear_num_value_heads"])
    u32("ssm.inner_size", hparams["linear_value_head_dim"] * hparams["linear_num_value_heads"])
    if (layer_types := hparams.get("layer_types")) is not None:
        recurrent = [t == "linear_attention" for t in layer_types] + [False] * num_mtp
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    u32("full_attention_interval", hparams.get("full_attention_interval", 4))
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    u32("rope.dimension_count", int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch in ("qwen35", "qwen35moe") and "mrope_section" not in rope:
        writer.add_array(f"{arch}.rope.dimension_sections", DEFAULT_MROPE_SECTIONS)
    writer.add_uint32("general.quantization_version", GGML_QUANT_VERSION)


def add_hf_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """`_set_vocab_gpt2` for the checkpoint at `model_dir` (tokenizer.json and the files SpecialVocab reads)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise DeltaspecError(f"{model_dir} has no tokenizer.json; a GGUF file for llama.cpp needs the tokenizer.")
    try:
        document = json.loads(path.read_text())
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - json and tokenizers raise their own error types
        raise DeltaspecError(f"{path} is not a readable tokenizer.json ({exc}).") from None
    if document.get("model", {}).get("type") != "BPE":
        raise DeltaspecError(f"{path} is not a byte-level BPE tokenizer, the kind llama.cpp's Qwen models use.")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre_tokenizer(path, document, backend))
    tokens, types = vocabulary(path, document, vocab_size)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def vocabulary(path: Path, document: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """`get_vocab_base`: the token of every id below `vocab_size` and its type."""
    by_id = {i: token for token, i in document["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in document.get("added_tokens", [])}
    by_id.update({i: entry["content"] for i, entry in added.items()})
    if by_id and max(by_id) >= vocab_size:
        raise DeltaspecError(f"{path} has token id {max(by_id)}, beyond the model's vocabulary of {vocab_size}.")
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added and (added[i].get("special") or (token.startswith("<|") and token.endswith("|>"))):
            tokens.append(token)
            types.append(CONTROL)
        elif i in added:
            tokens.append(token.replace("\u2581", " "))
            types.append(USER_DEFINED)
        else:
            tokens.append(token)
            types.append(NORMAL)
    return tokens, types


def pre_tokenizer(path: Path, document: dict, backend: tokenizers.Tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (see the module docstring)."""
    ids = backend.encode(CHECK_TEXT).ids
    if (name := KNOWN_HASHES.get(sha256(str(ids).encode()).hexdigest())) is not None:
        return name
    splits = [
        step["pattern"].get("Regex")
        for step in (document.get("pre_tokenizer") or {}).get("pretokenizers", [])
        if step.get("type") == "Split"
    ]
    for name, regex in PRE_TOKENIZERS.items():
        if splits == [regex]:
            return name
    raise DeltaspecError(
        f"The pre-tokenizer of {path} is neither Qwen2's nor Qwen3.5's, so llama.cpp would split text differently "
        "from this tokenizer; deltaspec writes GGUF files for those two."
    )


def add_gguf_tokenizer(writer: gguf.GGUFWriter, metadata: dict[str, Any]) -> None:
    """The `tokenizer.*` keys of a GGUF file's metadata, with the value types the converter gives them."""
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
