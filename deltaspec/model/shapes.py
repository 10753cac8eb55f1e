"""Real model shapes without checkpoints: `--random-weights --shape NAME` (issue #6).

Each shape is the text model of a published checkpoint as a `ModelConfig`, with the values of its
`config.json`. Sources (looked up, not guessed, except where a comment says so): the transformers
defaults of `Qwen3_5TextConfig` (= Qwen3.5-9B), `Qwen3_5MoeTextConfig` (= Qwen3.5-35B-A3B) and
`Qwen3NextConfig` (= Qwen3-Next-80B-A3B), published config.json files and model cards, and the
Megatron model arguments of THUDM/slime (`scripts/models/qwen3.5-*.sh`, `qwen3-next-80B-A3B.sh`).

`parameter_counts` counts a shape's parameters from the config alone (nothing is allocated): the
memory planner and the benchmarks' bytes-per-step use it for random-weight models.
"""

from __future__ import annotations

from dataclasses import fields, replace

from deltaspec.config.model import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, MoEConfig
from deltaspec.errors import DeltaspecError


def _layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _shape(
    model_type: str,
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    gdn_k_heads: int,
    gdn_v_heads: int,
    vocab: int,
    tied: bool,
    moe: MoEConfig | None = None,
    head_dim: int = 256,
    gdn_head_dim: int = 128,
    rope_theta: float = 1e7,
    mtp_layers: int = 1,
) -> ModelConfig:
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        layer_types=_layer_types(layers),
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        attention_bias=False,
        linear_num_key_heads=gdn_k_heads,
        linear_num_value_heads=gdn_v_heads,
        linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim,
        linear_conv_kernel_dim=4,
        gdn_layout="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
        moe=moe,
        moe_layers=(moe is not None,) * layers,
        num_mtp_layers=mtp_layers,
    )


SHAPES: dict[str, ModelConfig] = {
    # slime qwen3.5-27B.sh + the issue: 64 layers, 24 q / 4 kv heads of 256, GDN 16 k / 48 v heads of 128, untied.
    "qwen3.5-27b": _shape(
        "qwen3_5_text",
        layers=64,
        hidden=5120,
        ffn=17408,
        heads=24,
        kv_heads=4,
        gdn_k_heads=16,
        gdn_v_heads=48,
        vocab=248320,
        tied=False,
    ),
    # Model card / config.json: 32 layers, 16 q / 4 kv, GDN 16 k / 32 v. tie_word_embeddings was not found in
    # any source read; untied is assumed (the transformers default).
    "qwen3.5-9b": _shape(
        "qwen3_5_text",
        layers=32,
        hidden=4096,
        ffn=12288,
        heads=16,
        kv_heads=4,
        gdn_k_heads=16,
        gdn_v_heads=32,
        vocab=248320,
        tied=False,
    ),
    # slime qwen3.5-0.8B.sh (no --untie-embeddings-and-output-weights: tied). GDN 16 k / 16 v heads of 128 comes
    # from one secondary source (a tutorial's description of the 0.8B's GDN layers), not from config.json.
    "qwen3.5-0.8b": _shape(
        "qwen3_5_text",
        layers=24,
        hidden=1024,
        ffn=3584,
        heads=8,
        kv_heads=2,
        gdn_k_heads=16,
        gdn_v_heads=16,
        vocab=248320,
        tied=True,
    ),
    # transformers Qwen3_5MoeTextConfig defaults + slime qwen3.5-35B-A3B.sh: every layer MoE, 256 experts, top 8.
    "qwen3.5-35b-a3b": _shape(
        "qwen3_5_moe_text",
        layers=40,
        hidden=2048,
        ffn=0,
        heads=16,
        kv_heads=2,
        gdn_k_heads=16,
        gdn_v_heads=32,
        vocab=248320,
        tied=False,
        moe=MoEConfig(
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
        ),
    ),
    # transformers Qwen3NextConfig defaults + slime qwen3-next-80B-A3B.sh (ffn 5120, rope base 1e7, 1 MTP layer).
    "qwen3-next-80b-a3b": _shape(
        "qwen3_next",
        layers=48,
        hidden=2048,
        ffn=5120,
        heads=16,
        kv_heads=2,
        gdn_k_heads=16,
        gdn_v_heads=32,
        vocab=151936,
        tied=False,
        moe=MoEConfig(
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
        ),
    ),
}
# The MTP layer count of the 9B, 0.8B and 35B-A3B is assumed to be 1 like the 27B's and 80B's (their cards say
# "MTP: trained with multi-steps" without the config value).

MOE_FIELDS = {f.name for f in fields(MoEConfig)}


def shape_config(name: str, overrides: tuple[tuple[str, int], ...] | dict = ()) -> ModelConfig:
    """The `ModelConfig` of shape `name`. `overrides` (Python only, for fast tests) replace ModelConfig or
    MoEConfig fields; changing `num_hidden_layers` re-derives the layer types (one attention layer in four)."""
    if name not in SHAPES:
        raise DeltaspecError(f"Unknown shape {name!r}; use one of {', '.join(SHAPES)}.")
    config, changes = SHAPES[name], dict(overrides)
    moe_changes = {k: v for k, v in changes.items() if k in MOE_FIELDS}
    if moe_changes and config.moe is None:
        raise DeltaspecError(f"Shape {name} is dense; it has no MoE fields to override ({', '.join(moe_changes)}).")
    if moe_changes:
        changes = {k: v for k, v in changes.items() if k not in MOE_FIELDS} | {
            "moe": replace(config.moe, **moe_changes)
        }
    if "num_hidden_layers" in changes:
        n = changes["num_hidden_layers"]
        changes.setdefault("layer_types", _layer_types(n))
        changes.setdefault("moe_layers", (config.moe is not None,) * n)
    try:
        return replace(config, **changes)
    except TypeError as exc:
        raise DeltaspecError(f"Bad shape override for {name}: {exc}.") from None


def _mlp_params(config: ModelConfig, moe: bool) -> dict[str, int]:
    """{"dense": ..., "experts": ..., "router": ...} parameters of one MLP block."""
    h = config.hidden_size
    if not moe or config.moe is None:
        return {"dense": 3 * h * config.intermediate_size}
    m = config.moe
    shared = 3 * h * m.shared_expert_intermediate_size + h if m.shared_expert_intermediate_size else 0
    return {"dense": shared + h * m.num_experts, "experts": m.num_experts * 3 * h * m.moe_intermediate_size}


def _attention_params(config: ModelConfig) -> int:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    bias = (2 * q + 2 * kv + h) if config.attention_bias else 0
    return h * 2 * q + 2 * h * kv + q * h + 2 * d + bias


def _gdn_params(config: ModelConfig) -> int:
    h, hv = config.hidden_size, config.linear_num_value_heads
    value_dim = hv * config.linear_value_head_dim
    return (
        h * (config.gdn_conv_dim + value_dim + 2 * hv)
        + config.gdn_conv_dim * config.linear_conv_kernel_dim
        + 2 * hv
        + config.linear_value_head_dim
        + value_dim * h
    )


def parameter_counts(config: ModelConfig, num_mtp_layers: int | None = None) -> dict[str, int]:
    """Parameters by part: embedding, lm_head (0 when tied), layers' dense weights, routed experts, mtp
    (its own weights; it shares the embedding and LM head), and the total."""
    h = config.hidden_size
    mtp_layers = config.num_mtp_layers if num_mtp_layers is None else num_mtp_layers
    dense = experts = 0
    for kind, moe in zip(config.layer_types, config.moe_layers):
        mlp = _mlp_params(config, moe)
        mixer = _gdn_params(config) if kind == LINEAR_ATTENTION else _attention_params(config)
        dense += mixer + mlp["dense"] + 2 * h
        experts += mlp.get("experts", 0)
    mtp = 0
    if mtp_layers:
        mlp = _mlp_params(config, config.moe is not None)
        mtp = 2 * h * h + 3 * h + mtp_layers * (_attention_params(config) + sum(mlp.values()) + 2 * h)
    counts = {
        "embedding": config.vocab_size * h,
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * h,
        "layers": dense + h,
        "experts": experts,
        "mtp": mtp,
    }  # + h: the final norm
    counts["total"] = sum(counts.values())
    return counts
