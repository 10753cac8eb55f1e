"""Tiny random checkpoints made with transformers' own model classes (test helper).

Each `write_*` function saves a checkpoint directory with `save_pretrained`, plus a tiny
tokenizer when asked, so tests can compare deltaspec against the reference implementation.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

VOCAB = 512


def _common(**overrides) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    base.update(overrides)
    return base


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norm weights to constants; random ones make parity tests sharper."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))


def make_model(kind: str, seed: int = 0, **overrides):
    """Build a random transformers model: kind in qwen3_5, qwen3_5_moe, qwen3_next."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = tf.Qwen3_5TextConfig(**_common(**overrides))
        model = tf.Qwen3_5ForCausalLM(config)
    elif kind == "qwen3_5_moe":
        moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        config = tf.Qwen3_5MoeTextConfig(**_common(**(moe | overrides)))
        model = tf.Qwen3_5MoeForCausalLM(config)
    elif kind == "qwen3_next":
        moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        config = tf.Qwen3NextConfig(**_common(**(moe | dict(decoder_sparse_step=1, norm_topk_prob=True) | overrides)))
        model = tf.Qwen3NextForCausalLM(config)
    else:
        raise ValueError(kind)
    _randomize_norms(model, seed)
    return model.eval()


def write_checkpoint(directory: Path, kind: str, seed: int = 0, tokenizer: bool = False, **overrides) -> Path:
    """Save a random model of `kind` to `directory` (float32 safetensors)."""
    model = make_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    if tokenizer:
        from tests.tiny_tokenizer import write_tiny_tokenizer

        write_tiny_tokenizer(directory)
    return directory


def add_mtp_weights(directory: Path, num_layers: int = 1, seed: int = 1) -> None:
    """Add random `mtp.*` tensors (the layout Qwen3.5 checkpoints ship) to a saved checkpoint; the MTP layer's MLP is
    the model's kind (a MoE model's has routed experts, one tensor per expert, and a shared expert)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((directory / "config.json").read_text())
    h, heads, kv, d = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "mtp.fc.weight": rand(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": rand(h),
        "mtp.pre_fc_norm_hidden.weight": rand(h),
        "mtp.norm.weight": rand(h),
    }
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": rand(h),
                p + "post_attention_layernorm.weight": rand(h),
                p + "self_attn.q_proj.weight": rand(2 * heads * d, h),
                p + "self_attn.k_proj.weight": rand(kv * d, h),
                p + "self_attn.v_proj.weight": rand(kv * d, h),
                p + "self_attn.o_proj.weight": rand(h, heads * d),
                p + "self_attn.q_norm.weight": rand(d),
                p + "self_attn.k_norm.weight": rand(d),
            }
        )
        tensors.update(_mtp_mlp(config, p + "mlp.", rand))
    weights = load_file(directory / "model.safetensors")
    weights.update(tensors)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _mtp_mlp(config: dict, p: str, rand) -> dict[str, torch.Tensor]:
    """The MTP layer's MLP tensors under prefix `p`: SwiGLU, or the model's MoE as released checkpoints store it."""
    h = config["hidden_size"]
    if not config.get("num_experts"):
        i = config["intermediate_size"]
        return {
            p + "gate_proj.weight": rand(i, h),
            p + "up_proj.weight": rand(i, h),
            p + "down_proj.weight": rand(h, i),
        }
    i, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    tensors = {
        p + "gate.weight": rand(config["num_experts"], h, scale=0.5),
        p + "shared_expert_gate.weight": rand(1, h),
    }
    for e in range(config["num_experts"]):
        tensors |= {f"{p}experts.{e}.{n}_proj.weight": rand(i, h) for n in ("gate", "up")}
        tensors[f"{p}experts.{e}.down_proj.weight"] = rand(h, i)
    tensors |= {f"{p}shared_expert.{n}_proj.weight": rand(shared, h) for n in ("gate", "up")}
    tensors[p + "shared_expert.down_proj.weight"] = rand(h, shared)
    return tensors


def write_block_drafter(
    directory: Path,
    target: Path,
    seed: int = 0,
    num_layers: int = 2,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] = (0, 2),
    mask_token_id: int = 3,
    **overrides,
) -> Path:
    """Save a random block drafter for the checkpoint at `target` in the layout of z-lab's DFlash drafters
    (`config.json` with `dflash_config`, top-level `fc` / `hidden_norm` / `layers.N.*` / `norm` tensors; the
    embeddings and LM head are the target's)."""
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    h = cfg["hidden_size"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": cfg["num_hidden_layers"],
        "num_hidden_layers": num_layers,
        "hidden_size": h,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "layer_types": ["full_attention"] * num_layers,
        "vocab_size": cfg["vocab_size"],
    }
    config.update(overrides)
    heads, kv, d, inter = (
        config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=gen) * scale

    def norm(dim):
        return 1.0 + rand(dim, scale=0.1)  # Qwen3 norms: plain weights around 1

    tensors = {"fc.weight": rand(h, len(target_layer_ids) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": rand(heads * d, h),
                p + "self_attn.k_proj.weight": rand(kv * d, h),
                p + "self_attn.v_proj.weight": rand(kv * d, h),
                p + "self_attn.o_proj.weight": rand(h, heads * d),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


# dimensions whose matrices all have input sizes divisible by 128, as FP8 block-scaled checkpoints need, even
# when two tensor-parallel ranks split the row-parallel ones
FP8_DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=64, linear_value_head_dim=64)
FP8_MOE_DIMS = FP8_DIMS | dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
FP8_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "conv1d", "in_proj_b.", "in_proj_a.")


def _copy_all_but_weights(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())


def write_fp8_checkpoint(source: Path, target: Path) -> Path:
    """A copy of float checkpoint `source` in the layout of Qwen's `-FP8` releases: every other matrix as float8
    e4m3 `weight` with a float32 `weight_scale_inv` per 128 x 128 tile (amax / 448, as transformers' fine-grained
    FP8 quantizer scales), the embeddings, norms, routers, conv and GDN b / a projections in bf16."""
    from safetensors.torch import load_file, save_file

    from deltaspec.ops.quant.fp8 import quantize_tiles

    _copy_all_but_weights(source, target)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG | {"modules_to_not_convert": list(FP8_KEPT)}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for name, tensor in load_file(next(source.glob("*.safetensors"))).items():
        if tensor.dim() == 2 and name.endswith(".weight") and not any(kept in name for kept in FP8_KEPT):
            tensors[name], tensors[name + "_scale_inv"] = quantize_tiles(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def dequantize_fp8_tiles(values: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """values [out, in] e4m3 times each one's tile scale, in float32: transformers' `_dequantize_fp8_weight`
    (integrations/finegrained_fp8, transformers 5.2x; older releases lack it, so the test of the blocks compares
    the two where it exists)."""
    rows, columns = values.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :columns]
    return values.float() * scale


def write_dequantized_checkpoint(source: Path, target: Path) -> Path:
    """A float32 copy of FP8 checkpoint `source`, each matrix dequantized as transformers does."""
    from safetensors.torch import load_file, save_file

    _copy_all_but_weights(source, target)
    config = json.loads((source / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(source / "model.safetensors")
    floats = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        floats[name] = tensor.float() if scale is None else dequantize_fp8_tiles(tensor, scale, block)
    save_file(floats, target / "model.safetensors", metadata={"format": "pt"})
    return target


INT4_DIMS = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_value_head_dim=64)
INT4_MOE_DIMS = INT4_DIMS | dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)


def write_int4_checkpoints(
    source: Path, root: Path, layout: str, group: int, symmetric: bool, act_order: bool = False
) -> tuple[Path, Path]:
    """An int4 W4A16 copy of float checkpoint `source` under `root` in `layout` ("compressed-tensors": written by
    the compressed-tensors library's own quantizer and pack-quantized compressor; "gptq" / "gptq_v2": AutoGPTQ's
    layout, zero points stored minus one in the original format), every matrix but those of FP8_KEPT in groups
    of `group` input columns, in bf16 (compressed-tensors) or fp16 (GPTQ) scales; and a float32 copy of it whose
    matrices are the int4 weights dequantized exactly, s * (q - z). `act_order` (GPTQ layouts): each matrix's
    groups taken in a random order of its input columns, as GPTQ's `desc_act` does, recorded in `g_idx`.
    Returns (quantized, dequantized)."""
    from safetensors.torch import load_file, save_file

    quantized = root / f"{source.name}-{layout}-{group}-{'sym' if symmetric else 'asym'}{'-actorder' * act_order}"
    dequantized = quantized.with_name(quantized.name + "-dequantized")
    _copy_all_but_weights(source, quantized)
    _copy_all_but_weights(source, dequantized)
    write = _compressed_int4 if layout == "compressed-tensors" else _gptq_int4
    packed, floats = {}, {}
    tensors = {name: t for file in sorted(source.glob("*.safetensors")) for name, t in load_file(file).items()}
    for directory in (quantized, dequantized):  # one file each, whatever the source's sharding
        (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and name.endswith(".weight") and not any(kept in name for kept in FP8_KEPT):
            order_seed = _input_seed(name) if act_order else None
            stored, floats[name] = write(tensor, group, symmetric, layout, order_seed)
            packed.update({f"{name.removesuffix('.weight')}.{suffix}": value for suffix, value in stored.items()})
        else:
            packed[name] = tensor.to(torch.bfloat16)
            floats[name] = packed[name].float()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _int4_config(layout, group, symmetric, act_order)
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, dequantized / "model.safetensors", metadata={"format": "pt"})
    return quantized, dequantized


def _int4_config(layout: str, group: int, symmetric: bool, act_order: bool) -> dict:
    if layout != "compressed-tensors":
        return dict(
            quant_method="gptq", bits=4, group_size=group, desc_act=act_order, sym=symmetric, checkpoint_format=layout
        )
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    scheme.weights.group_size = group
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=list(FP8_KEPT))
    return json.loads(config.model_dump_json())


def _input_seed(name: str) -> int:
    """One seed per input that matrices read (the projections of one input share it, as their GPTQ order)."""
    prefix, _, proj = name.removesuffix(".weight").rpartition(".")
    shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    shared |= {"in_proj_qkv": "gdn", "in_proj_z": "gdn", "in_proj_b": "gdn", "in_proj_a": "gdn"}
    return zlib.crc32(f"{prefix}.{shared.get(proj, proj)}".encode())


def _compressed_int4(weight: torch.Tensor, group: int, symmetric: bool, layout: str, order_seed: int | None):
    """The library's tensors of one matrix and its exact float32 dequantization (static groups only)."""
    assert order_seed is None, "the act-order fixtures are GPTQ's"
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    scheme.weights.group_size = group
    weight = weight.to(torch.bfloat16)
    groups = weight.unflatten(-1, (-1, group))  # [out, in / G, G]
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    stored = PackedQuantizationCompressor.compress(state, scheme)
    q = unpack_from_int32(stored["weight_packed"], 4, weight.shape).float().unflatten(-1, (-1, group))
    zero = 0.0 if symmetric else zero_point.float()[..., None]
    return stored, ((q - zero) * scale.float()[..., None]).flatten(-2)


def _gptq_int4(weight: torch.Tensor, group: int, symmetric: bool, layout: str, order_seed: int | None):
    """AutoGPTQ's `qweight`, `qzeros`, `scales` and `g_idx` of one matrix (min-max scales, as its quantizer
    starts from) and its exact float32 dequantization. In activation order (an `order_seed`), group i holds the
    columns order[i * G : (i + 1) * G] of a random permutation `order` of the seed (AutoGPTQ's sorts the
    input's Hessian diagonal, so projections of one input share it), g_idx[order[j]] = j // G; qweight keeps
    the columns where they are."""
    rows, columns = weight.shape
    order = torch.arange(columns)
    if order_seed is not None:
        order = torch.randperm(columns, generator=torch.Generator().manual_seed(order_seed))
    g_idx = torch.empty(columns, dtype=torch.int32)
    g_idx[order] = torch.arange(columns, dtype=torch.int32) // group
    groups = weight.float()[:, order].unflatten(-1, (-1, group))  # [out, in / G, G]: group i's columns
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if symmetric:
        high = torch.maximum(-low, high)
        low = -high
    scale = ((high - low) / 15).clamp(min=1e-8).half()  # [out, in / G]
    zero = torch.full_like(scale, 8, dtype=torch.int32) if symmetric else torch.round(-low / scale.float()).int()
    grouped = (torch.round(groups / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).int()
    stored_zero = zero - (1 if layout == "gptq" else 0)  # the original format's off-by-one
    q, dequantized = torch.empty(rows, columns, dtype=torch.int32), torch.empty(rows, columns)
    q[:, order] = grouped.flatten(-2)  # [out, in], columns where they are
    dequantized[:, order] = (grouped - zero[..., None]).float().mul(scale.float()[..., None]).flatten(-2)
    return {
        "qweight": _pack_nibbles(q.t(), dim=0),  # [in / 8, out]
        "qzeros": _pack_nibbles(stored_zero.t(), dim=1),  # [in / G, out / 8]
        "scales": scale.t().contiguous(),  # [in / G, out]
        "g_idx": g_idx,
    }, dequantized


def _pack_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values (int32) packed eight to an int32 along `dim`, value 8w + j in bits 4j of word w."""
    values = values.movedim(dim, -1).unflatten(-1, (-1, 8)).to(torch.int64)
    words = (values << (4 * torch.arange(8))).sum(-1)
    return words.to(torch.uint32).view(torch.int32).movedim(-1, dim).contiguous()
