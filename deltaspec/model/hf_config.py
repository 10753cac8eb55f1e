"""Parse a Hugging Face `config.json` into a `ModelConfig`.

Supported model types: `qwen3_5` / `qwen3_5_moe` (multimodal wrappers: the text model lives in
`text_config`), `qwen3_5_text`, `qwen3_5_moe_text` and `qwen3_next`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaspec.config.model import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, MoEConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.config_sizes import SIZE_RANGES, checked_size, config_size

WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_TYPES = (*WRAPPER_TYPES, *TEXT_TYPES)
MAX_CONFIG_BYTES = 64 * 2**20


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """The JSON object in `model_dir`'s config.json (at most `MAX_CONFIG_BYTES` of it read)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise DeltaspecError(f"{model_dir} has no config.json; point --model at a Hugging Face checkpoint directory.")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise DeltaspecError(
            f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB, so it is no model config; restore the checkpoint's "
            "config.json."
        )
    try:
        raw = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise DeltaspecError(f"{path} is not valid JSON ({exc}); restore the checkpoint's config.json.") from None
    if not isinstance(raw, dict):
        raise DeltaspecError(f"{path} must hold a JSON object; restore the checkpoint's config.json.")
    return raw


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The text-model part of a config: `text_config` for wrapper types, the config itself otherwise."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise DeltaspecError(
            f"Model type {model_type!r} is not supported; deltaspec runs {', '.join(SUPPORTED_TYPES)}."
        )
    if model_type in WRAPPER_TYPES:
        if not isinstance(raw.get("text_config") or {}, dict):
            raise DeltaspecError(
                "config.json's text_config must be a JSON object; restore the checkpoint's config.json."
            )
        text = dict(raw.get("text_config") or {})
        text.setdefault("model_type", WRAPPER_TYPES[model_type])
        for key in ("tie_word_embeddings", "eos_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        return text
    return raw


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    text = text_config_of(raw)
    return text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise DeltaspecError(
            f"RoPE type {rope_type!r} is not supported yet; deltaspec supports the default (unscaled) RoPE."
        )
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(partial)


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = config_size(text, "full_attention_interval", 4)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types)
    ):
        raise DeltaspecError(
            f"layer_types must list {num_layers} entries, each 'linear_attention' or 'full_attention'."
        )
    return tuple(layer_types)


def _moe(text: dict[str, Any], model_type: str, num_layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    num_experts = config_size(text, "num_experts", 0)
    if num_experts == 0 or model_type == "qwen3_5_text":
        return None, (False,) * num_layers
    moe = MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=checked_size((1, num_experts), "num_experts_per_tok", text["num_experts_per_tok"]),
        moe_intermediate_size=config_size(text, "moe_intermediate_size"),
        shared_expert_intermediate_size=config_size(text, "shared_expert_intermediate_size", 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
    )
    if model_type == "qwen3_5_moe_text":
        return moe, (True,) * num_layers
    step = config_size(text, "decoder_sparse_step", 1)
    mlp_only = set(text.get("mlp_only_layers") or [])
    return moe, tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from a parsed `config.json`; a missing field, a field of the wrong type and a size out
    of range (`config_sizes.SIZE_RANGES`, checked before anything is built from it) each get one clear sentence."""
    text = text_config_of(raw)
    model_type = text.get("model_type", raw.get("model_type"))
    try:
        num_layers = config_size(text, "num_hidden_layers")
        hidden = config_size(text, "hidden_size")
        heads = config_size(text, "num_attention_heads")
        theta, partial = _rope(text)
        moe, moe_layers = _moe(text, model_type, num_layers)
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            model_type=model_type,
            vocab_size=config_size(text, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=config_size(text, "intermediate_size", 0),
            num_hidden_layers=num_layers,
            layer_types=_layer_types(text, num_layers),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            num_attention_heads=heads,
            num_key_value_heads=config_size(text, "num_key_value_heads", heads),
            head_dim=config_size(text, "head_dim", hidden // heads),
            rope_theta=theta,
            partial_rotary_factor=partial,
            max_position_embeddings=config_size(text, "max_position_embeddings", 32768),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=config_size(text, "linear_num_key_heads"),
            linear_num_value_heads=config_size(text, "linear_num_value_heads"),
            linear_key_head_dim=config_size(text, "linear_key_head_dim"),
            linear_value_head_dim=config_size(text, "linear_value_head_dim"),
            linear_conv_kernel_dim=config_size(text, "linear_conv_kernel_dim", 4),
            gdn_layout="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
            moe=moe,
            moe_layers=moe_layers,
            num_mtp_layers=_mtp_layers(text),
            eos_token_ids=eos_ids,
        )
    except KeyError as exc:
        raise DeltaspecError(f"config.json lacks the field {exc.args[0]!r} that a {model_type} model needs.") from None
    except (TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeltaspecError(
            f"config.json has a field of the wrong type ({reason}); restore the checkpoint's config.json."
        ) from None


def _mtp_layers(text: dict[str, Any]) -> int:
    """The MTP head's layer count: `mtp_num_hidden_layers`, or DeepSeek's spelling `num_nextn_predict_layers`."""
    key = "mtp_num_hidden_layers" if "mtp_num_hidden_layers" in text else "num_nextn_predict_layers"
    return checked_size(SIZE_RANGES["mtp_num_hidden_layers"], key, text.get(key) or 0)
