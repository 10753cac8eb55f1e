"""`ModelConfig`: the architecture as deltaspec understands it, whatever checkpoint format it came from
(`deltaspec.model.hf_config` parses Hugging Face `config.json` into it, `deltaspec.model.gguf_config` a GGUF file's
metadata), with its mixture-of-experts part `MoEConfig` and the names of the two layer types."""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLP: softmax router, top-k experts, optional shared expert. With expert parallelism
    (`expert_parallel_size` ranks) the router still scores all `num_experts`; each rank holds `held_experts`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    expert_parallel_size: int = 1

    @property
    def held_experts(self) -> int:
        """The routed experts one rank holds."""
        return self.num_experts // self.expert_parallel_size


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one hybrid GDN / gated-attention model (DESIGN §1)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_layout: str  # "qwen3_5": in_proj_qkv/z/b/a; "qwen3_next": grouped in_proj_qkvz/ba
    # MLP: per layer, True where the layer's MLP is a mixture of experts
    moe: MoEConfig | None
    moe_layers: tuple[bool, ...]
    # multi-token-prediction head
    num_mtp_layers: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
