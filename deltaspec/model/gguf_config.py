"""A transformers-style `config.json` dict rebuilt from a GGUF file's metadata (and which tensors it has).

Owns the architectures deltaspec reads from GGUF (`qwen35`, `qwen35moe`, `qwen3next`) and the inverse of what
llama.cpp's converter writes for them (conversion/base.py `TextModel.set_gguf_parameters`, conversion/qwen.py
`Qwen2MoeModel`, `Qwen3NextModel`, `_QwenMtpMixin`), so that `parse_model_config` of the result equals that of
the original config.json. What the metadata does not carry is read off the tensors: tied embeddings (no
`output.weight`), attention biases, dense layers of a Qwen3-Next MoE. The end-of-sequence id is the tokenizer's
(`tokenizer.ggml.eos_token_id`): config.json's own `eos_token_id` is not kept by the converter.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaspec.config.model import FULL_ATTENTION, LINEAR_ATTENTION
from deltaspec.errors import DeltaspecError
from deltaspec.model.config_sizes import SIZE_RANGES, checked_size
from deltaspec.model.gguf_raw import RawGGUF

# GGUF architecture -> (transformers model_type, transformers class)
ARCHITECTURES = {
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}
MOE_ARCHITECTURES = ("qwen35moe", "qwen3next")
# decoder and MTP blocks together, checked before any per-layer list is built (the other sizes are checked by
# `parse_model_config`)
BLOCK_RANGE = (1, SIZE_RANGES["num_hidden_layers"][1] + SIZE_RANGES["mtp_num_hidden_layers"][1])


def architecture_of(raw: RawGGUF) -> str:
    """The file's `general.architecture`, if deltaspec reads it."""
    arch = raw.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DeltaspecError(
            f"{raw.path} holds a {arch!r} model; deltaspec reads the GGUF architectures {', '.join(ARCHITECTURES)}."
        )
    return arch


def config_from_gguf(raw: RawGGUF) -> dict[str, Any]:
    """The config.json (text model) of the checkpoint `raw` was converted from; metadata of the wrong type, or
    sizes that would make it build absurd lists, in one sentence."""
    arch = architecture_of(raw)
    try:
        return _config(raw, arch)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeltaspecError(
            f"{raw.path} has metadata of the wrong type or value ({reason}); the file is corrupt."
        ) from None


def _config(raw: RawGGUF, arch: str) -> dict[str, Any]:
    """`config_from_gguf` of the file `raw` of architecture `arch`."""
    model_type, hf_class = ARCHITECTURES[arch]

    def key(name: str, default: Any = ...) -> Any:
        value = raw.metadata.get(f"{arch}.{name}", default)
        if value is ...:
            raise DeltaspecError(f"{raw.path} lacks the metadata key {arch}.{name} that a {arch} model needs.")
        return value

    block_count = checked_size(BLOCK_RANGE, f"{arch}.block_count", key("block_count"))
    num_mtp = checked_size((0, block_count - 1), f"{arch}.nextn_predict_layers", key("nextn_predict_layers", 0))
    num_layers = block_count - num_mtp
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    value_heads = int(key("ssm.time_step_rank"))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": _vocab_size(raw),
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "layer_types": _layer_types(key, num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(raw, key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": _rope(key, head_dim),
        "attention_bias": any(name.endswith(".attn_q.bias") for name in raw.tensors),
        "tie_word_embeddings": "output.weight" not in raw.tensors,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
    }
    if (intermediate := key("feed_forward_length", None)) is not None:
        config["intermediate_size"] = int(intermediate)
    if arch in MOE_ARCHITECTURES:
        config.update(
            num_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
        )
    if arch == "qwen3next":
        config.update(
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in raw.tensors],
            norm_topk_prob=bool(key("expert_weights_norm", True)),
        )
    for token in ("bos", "eos", "pad"):
        if (token_id := raw.metadata.get(f"tokenizer.ggml.{token}_token_id")) is not None:
            config[f"{token}_token_id"] = int(token_id)
    if num_mtp:
        config["mtp_num_hidden_layers"] = num_mtp
    return config


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _vocab_size(raw: RawGGUF) -> int:
    """Rows of the embedding table (the converter writes no vocab size for these architectures)."""
    embedding = raw.tensors.get("token_embd.weight")
    if embedding is None:
        raise DeltaspecError(f"{raw.path} has no token_embd.weight tensor, so it holds no complete model.")
    return embedding.shape[0]


def _kv_heads(raw: RawGGUF, value: int | list[int]) -> int:
    """`head_count_kv`: one number, or one per layer (then the same for every attention layer)."""
    if isinstance(value, list):
        counts = {int(v) for v in value if v}
        if len(counts) != 1:
            raise DeltaspecError(f"{raw.path} gives its attention layers different KV head counts, {sorted(counts)}.")
        value = counts.pop()
    return int(value)


def _layer_types(key, num_layers: int) -> list[str]:
    """Which layers are Gated DeltaNet: `attention.recurrent_layers` (MTP layers follow), else every layer but
    each `full_attention_interval`-th, as llama.cpp reads it."""
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is None:
        interval = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    return [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:num_layers]]


def _rope(key, head_dim: int) -> dict[str, Any]:
    """rope_parameters: theta, the rotated fraction of each head, and any scaling (which deltaspec refuses)."""
    rope = {
        "rope_type": "default",
        "rope_theta": _float32(key("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(key("rope.dimension_count", head_dim)) / head_dim,
    }
    if (sections := key("rope.dimension_sections", None)) is not None:  # the M-RoPE sections, for images
        rope["mrope_section"] = [int(n) for n in list(sections)[:3]]
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        rope["rope_type"] = scaling
        if (factor := key("rope.scaling.factor", None)) is not None:
            rope["factor"] = _float32(factor)
    return rope
