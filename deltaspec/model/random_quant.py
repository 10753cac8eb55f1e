"""`--random-weights --shape NAME --quant TYPE`: which GGUF type each random weight is quantized to.

TYPE is a llama.cpp preset (q4_k_m, q5_k_m, q6_k, q8_0: each tensor's type chosen as llama-quantize chooses it,
`deltaspec.ops.quant.presets`) or a single block type (q4_k, q8_0, iq4_xs, ...) for every matrix, as
`llama-quantize --pure` gives it (`pure_type`). The model's parameters are named as GGUF files name them
(`token_embd`, `blk.N.attn_qkv`, `blk.N.ffn_down_exps`, the MTP head as NextN blocks after the last layer), so
the choice is the one a file of that shape would get. What is not a matrix (norms, gates' biases, the conv
window, A_log, dt_bias) and the MoE router stay in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.formats import format_of, row_bytes
from deltaspec.ops.quant.presets import DEFAULT_TYPE, FALLBACK, allows_quantization, preset_types
from deltaspec.ops.quant.quantize import QUANTIZERS, quantize
from deltaspec.ops.quant.weight import QuantizedWeight

GGUF_SUFFIXES = {  # deltaspec parameter (within a layer) -> the GGUF tensor llama.cpp's converter writes
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_up_proj": "ffn_gate_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
POOL_BLOCKS = 1024  # quantized unit-normal blocks per type that `random_blocks` draws from
HALF_SCALES = ("d", "dmin", "m")  # float16 block fields each value of the block is linear in
FLOAT_SCALE = "scale"  # FP8_B128's float32 scale field, the I4 types' bfloat16 one
CHECKPOINT_TYPES = ("FP8_B128", "I4_G32", "I4_G128")  # the block types of Hugging Face quantized checkpoints
FP8_KEPT = ("token_embd.", "output.")  # kept float in those checkpoints, with the routers (ROUTER)
ROUTER = "ffn_gate_inp"  # a MoE layer's router and shared expert gate
MTP_FC = "mtp.fc.weight"


def gguf_name(name: str, config: ModelConfig) -> str | None:
    """The GGUF tensor a weight matrix parameter becomes, or None for what llama.cpp never quantizes."""
    if name in GLOBAL:
        return GLOBAL[name]
    if name == MTP_FC:
        return f"blk.{config.num_hidden_layers}.nextn.eh_proj.weight"
    prefix, _, rest = name.partition(".layers.")
    layer, _, suffix = rest.partition(".")
    if not rest or suffix not in GGUF_SUFFIXES:
        return None
    block = int(layer) + (config.num_hidden_layers if prefix == "mtp" else 0)
    return f"blk.{block}.{GGUF_SUFFIXES[suffix]}"


def parse_quant(quant: str) -> str:
    """A --quant value as presets and formats spell it (Q4_K_M, Q8_0, ...), or one sentence listing the choices."""
    key = {"FP8": "FP8_B128", "INT4": "I4_G128"}.get(quant.upper(), quant.upper())
    if key in DEFAULT_TYPE or key in QUANTIZERS:  # the block types deltaspec can quantize random weights to
        return key
    choices = ", ".join(p.lower() for p in DEFAULT_TYPE)
    raise DeltaspecError(
        f"Unknown --quant {quant!r}; use a preset ({choices}), fp8 (FP8_B128 blocks, an FP8 checkpoint's layout), "
        "int4 (I4_G128 blocks, a W4A16 checkpoint's; i4_g32 for groups of 32) or a block type such as q4_k or q8_0."
    )


def quantized_config(config: ModelConfig) -> ModelConfig:
    """The config a quantized random model is built with: a Qwen3-Next shape's GDN input projections separate
    (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), as a GGUF file of it loads (`gguf_names`), so each
    takes its own file tensor's type."""
    return replace(config, gdn_layout="qwen3_5")


def tensor_types(config: ModelConfig, shapes: dict[str, torch.Size], quant: str) -> dict[str, str]:
    """{parameter: GGUF type} for the parameters of `shapes` that are quantized under `quant`."""
    key = parse_quant(quant)
    named = {gguf_name(name, config): name for name, shape in shapes.items() if len(shape) >= 2}
    named.pop(None, None)
    if key not in DEFAULT_TYPE:
        chosen = {gguf: pure_type(key, gguf, tuple(shapes[name])) for gguf, name in named.items()}
        if key in CHECKPOINT_TYPES:  # a quantized checkpoint's layout: embeddings, LM head and routers stay float
            kept = [gguf for gguf in chosen if gguf.startswith(FP8_KEPT) or ROUTER in gguf]
            chosen |= dict.fromkeys(kept, "F16")
    else:
        n_expert = config.moe.num_experts if config.moe else 0
        listing = [(gguf, tuple(shapes[name]), "F32") for gguf, name in named.items()]
        blocks = config.num_hidden_layers + config.num_mtp_layers
        chosen = preset_types(key, listing, n_layers=blocks, n_expert=n_expert)
    return {named[gguf]: qtype for gguf, qtype in chosen.items() if not format_of(qtype).is_float}


def pure_type(qtype: str, name: str, shape: tuple[int, ...]) -> str:
    """What `llama-quantize --pure` makes of GGUF tensor `name` (torch `shape`) with `qtype`: F32 for what it never
    quantizes (norms, routers, the conv window); else `qtype`, its 32-element stand-in (llama-quant.cpp
    `tensor_type_fallback`) or F16, whichever has blocks that divide the row."""
    if not allows_quantization(name, shape):
        return "F32"
    for candidate in (qtype, FALLBACK.get(qtype, qtype)):
        if shape[-1] % format_of(candidate).block_size == 0:
            return candidate
    return "F16"


def random_blocks(
    shape: torch.Size, qtype: str, std: float, gen: torch.Generator, pools: dict[str, torch.Tensor]
) -> QuantizedWeight:
    """A [rows, cols] (or [experts, rows, cols]) weight of `qtype` blocks distributed like N(0, std²) quantized:
    each block is drawn from a pool of POOL_BLOCKS quantized N(0, 1) blocks (`pools`, quantized once per type
    with the exact quantizer, on `gen`'s device) and its float16 scales are multiplied by `std` (the values are
    linear in them, and the k-quant search is scale-invariant). Quantizing every drawn value instead takes about
    a minute for a 27B shape on an H200 (the k-quant search costs ~1 us per value on a CPU core)."""
    fmt = format_of(qtype)
    if qtype not in pools:
        unit = torch.randn(POOL_BLOCKS, fmt.block_size, generator=gen, device=gen.device)  # one block per row
        pools[qtype] = quantize(unit, qtype)  # [POOL_BLOCKS, type_size]
    rows, per_row = math.prod(shape[:-1]), shape[-1] // fmt.block_size
    picks = torch.randint(0, POOL_BLOCKS, (rows * per_row,), generator=gen, device=gen.device)
    blocks = pools[qtype][picks]  # [rows * per_row, type_size]
    offset = 0
    for name, size in fmt.fields:
        if name in HALF_SCALES:
            scale = blocks[:, offset : offset + 2].contiguous().view(torch.float16).float() * std
            blocks[:, offset : offset + 2] = scale.to(torch.float16).view(torch.uint8)
        if name == FLOAT_SCALE:
            scale_type = torch.float32 if size == 4 else torch.bfloat16
            scale = blocks[:, offset : offset + size].contiguous().view(scale_type).float() * std
            blocks[:, offset : offset + size] = scale.to(scale_type).view(torch.uint8)
        offset += size
    return QuantizedWeight([(qtype, blocks.view(*shape[:-1], per_row * fmt.type_size))], shape[-1])


def quantized_bytes(shape: torch.Size, qtype: str) -> int:
    """Bytes of a [..., rows, cols] weight in `qtype` blocks."""
    return math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
