"""`bench decode --compare-hf`: transformers' `generate` on the same shape and the same weights, same run.

The transformers model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` or `Qwen3NextForCausalLM`) is built
on the meta device from a config made from the engine's `ModelConfig`, then given the engine's weights by
`load_state_dict(model.hf_state_dict(), assign=True)`: views, no copy (conv weights are viewed as
[C, 1, K]). Its rotary tables are rebuilt on the device. Timing follows DESIGN §6 as far as `generate`
allows: t1 = time of generate(1 token) (prefill + first token), tN = time of generate(N tokens), decode
tok/s = (N - 1) / (median tN - median t1). transformers takes the GDN fast path (fla's kernels) when fla
is importable and usable on the device; the report says whether fla imported and which kernels
transformers said it replaced by its torch reference.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from deltaspec.bench.device import random_prompt, say, sync
from deltaspec.config.model import ModelConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError


def fla_version() -> str | None:
    try:
        import fla
    except Exception:  # noqa: BLE001 - any import failure means transformers falls back to torch
        return None
    return getattr(fla, "__version__", "unknown")


def hf_model_class(config: ModelConfig):
    """(config class, causal-LM class, extra config fields) of transformers for this model type."""
    import transformers

    moe = config.moe
    moe_fields = (
        {}
        if moe is None
        else {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        }
    )
    if config.model_type == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}
    if config.model_type == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, moe_fields
    if config.model_type == "qwen3_next":
        return (
            transformers.Qwen3NextConfig,
            transformers.Qwen3NextForCausalLM,
            moe_fields
            | {
                "norm_topk_prob": moe.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, m in enumerate(config.moe_layers) if not m],
            },
        )
    raise DeltaspecError(f"--compare-hf does not know the transformers class of {config.model_type}.")


def _as_hf_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A view of `tensor` in transformers' shape: conv weights [C, K] -> [C, 1, K]; fused experts transposed."""
    if tensor.shape == shape:
        return tensor
    if [d for d in tensor.shape if d != 1] == [d for d in shape if d != 1]:
        return tensor.view(shape)
    if tensor.dim() == 3 and tensor.transpose(1, 2).shape == shape:
        return tensor.transpose(1, 2)
    raise DeltaspecError(f"--compare-hf: {name} is {list(tensor.shape)} here but {list(shape)} in transformers.")


def hf_model(engine: Engine):
    """The transformers model of `engine`'s config, sharing the engine's weight memory."""
    config = engine.model_config
    config_cls, model_cls, extra = hf_model_class(config)
    hf_config = config_cls(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        layer_types=list(config.layer_types),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        **extra,
    )
    hf_config.dtype = engine.dtype
    with torch.device("meta"):
        model = model_cls(hf_config)
    wanted = model.state_dict()
    ours = engine.model.hf_state_dict()
    weights = {}
    for name, target in wanted.items():
        if name not in ours:
            raise DeltaspecError(f"--compare-hf: the engine has no weight for transformers' {name}.")
        weights[name] = _as_hf_shape(name, ours[name], target.shape)
    model.load_state_dict(weights, assign=True, strict=True)
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if type(child).__name__.endswith("RotaryEmbedding"):  # non-persistent buffers stayed on meta
                setattr(parent, child_name, type(child)(hf_config).to(engine.device))
    if meta := [n for n, b in model.named_buffers() if b.is_meta]:
        raise DeltaspecError(f"--compare-hf: transformers buffers {meta[:3]} were not rebuilt on the device.")
    return model.eval()


def _generate_seconds(model, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        use_cache=True,
    )
    sync(device)
    if out.shape[1] != prompt.shape[1] + new_tokens:
        raise DeltaspecError(f"transformers generated {out.shape[1] - prompt.shape[1]} tokens, not {new_tokens}.")
    return time.perf_counter() - start


class _Fallbacks(logging.Handler):
    """Collects transformers' "falling back to its reference PyTorch implementation" warnings."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "falling back" in record.getMessage():
            self.messages.append(record.getMessage().split(" is falling back")[0].strip("` "))


@torch.inference_mode()
def hf_decode(engine: Engine, context: int, max_tokens: int, runs: int) -> dict:
    """transformers' decode tok/s on the engine's weights, (N - 1) / (median tN - median t1), with its
    per-run times, version, whether fla was importable, and the kernels transformers said it replaced by
    torch code (`hf_fallbacks`; transformers versions that do not say so leave it empty)."""
    import transformers

    say("building the transformers model on the engine's weights ...")
    model = hf_model(engine)
    fallbacks = _Fallbacks()
    logger = logging.getLogger("transformers")
    logger.addHandler(fallbacks)
    try:  # the first prefill and decode steps are where transformers picks (and reports) its kernels
        _generate_seconds(
            model,
            torch.tensor([random_prompt(engine, context, 1 << 20)], device=engine.device),
            min(max_tokens, 4),
            engine.device,
        )
    finally:
        logger.removeHandler(fallbacks)
    per_run = []
    for i in range(runs):
        prompt = torch.tensor([random_prompt(engine, context, i)], device=engine.device)
        per_run.append(
            {
                "first_token_s": _generate_seconds(model, prompt, 1, engine.device),
                "total_s": _generate_seconds(model, prompt, max_tokens, engine.device),
            }
        )
        say(f"transformers run {i + 1}/{runs}: {max_tokens} tokens in {per_run[-1]['total_s']:.2f} s")
    decode_s = statistics.median(r["total_s"] for r in per_run) - statistics.median(r["first_token_s"] for r in per_run)
    if max_tokens < 2 or decode_s <= 0:
        raise DeltaspecError(
            f"transformers' decode time could not be told apart from its first token over "
            f"{max_tokens} tokens; raise --max-tokens."
        )
    return {
        "hf_decode_tok_s": (max_tokens - 1) / decode_s,
        "hf_per_run": per_run,
        "hf_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "fla_importable": fla_version() is not None,
        "fla_version": fla_version(),
        "hf_fallbacks": sorted(set(fallbacks.messages)),
    }
