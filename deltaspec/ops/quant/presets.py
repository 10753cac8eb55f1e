"""Which GGUF type llama-quantize gives each tensor under the presets Q4_K_M, Q5_K_M, Q6_K and Q8_0.

A transcription of llama.cpp's src/llama-quant.cpp for the architectures deltaspec runs (qwen35, qwen35moe,
qwen3next): `tensor_allows_quantization` (which tensors keep their own type), `tensor_get_category`,
`llama_tensor_get_type_impl` restricted to these presets, and `tensor_type_fallback` (a type whose blocks do
not divide the row falls back to a 32-element one, then to F16). LLM_TYPE_70B's rule is left out: it applies to
80-layer LLaMA models only. The rules, per preset (default: Q4_K, Q5_K, Q6_K, Q8_0):

    output.weight (and token_embd.weight when the file has no output.weight): Q6_K, or Q8_0 for the Q8_0
        preset or when the row is not a whole number of default-type blocks
    attn_v / attn_qkv / attn_kv_b: Q6_K for Q4_K_M and Q5_K_M when use_more_bits(i, n), i counting these
        tensors in file order (one per layer in Qwen3.5, so i is the layer); Q8_0 with exactly 8 experts
    ffn_down (also _exps, _shexp): Q6_K for Q4_K_M and Q5_K_M when use_more_bits(layer, n_layer)
    attn_k: Q8_0 with exactly 8 experts; attn_output: Q5_K for Q4_K_M with exactly 8 experts
    everything else that may be quantized: the default

with use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2, and n_layer the file's block count
(MTP layers included). `preset_types` replays llama-quantize over a whole tensor list (its order and counters);
`preset_type` decides one tensor.
"""

import re
from collections.abc import Iterable

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.formats import format_of

DEFAULT_TYPE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}  # llama_ftype_get_default_type

# llama-quant.cpp tensor_type_fallback: a type whose block does not divide the row -> a 32-element type
FALLBACK = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# tensor_allows_quantization: name fragments that keep a tensor in its own type (those that apply to any arch)
KEEP_FRAGMENTS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
KEEP_NAMES = ("position_embd.weight", "token_types.weight")
ATTN_V_FRAGMENTS = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")  # category_is_attn_v
LAYER = re.compile(r"blk\.(\d+)\.")


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """llama-quantize's tensor_allows_quantization: a 2-D+ `...weight` that is not a norm, router, conv, etc.

    `shape` is torch order ([..., rows, cols]); ggml counts a dimension only while a later one is > 1.
    """
    if all(size <= 1 for size in shape[:-1]):
        return False
    if not name.endswith("weight") or name in KEEP_NAMES:
        return False
    return not any(fragment in name for fragment in KEEP_FRAGMENTS)


def category(name: str) -> str:
    """tensor_get_category: "output", "token_embd", "attn_v" (v / qkv / kv_b), "attn_k", "attn_q",
    "attn_output", "ffn_up", "ffn_gate", "ffn_down" or "other", tested in llama.cpp's order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    if any(fragment in name for fragment in ATTN_V_FRAGMENTS):
        return "attn_v"
    for fragment, kind in (
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if fragment in name:
            return kind
    return "other"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def layer_of(name: str) -> int | None:
    """N of a `blk.N.` tensor name (sscanf's "blk.%d."), or None."""
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


def preset_type(
    preset: str,
    name: str,
    shape: tuple[int, ...],
    *,
    n_layers: int,
    n_expert: int = 0,
    tied_embeddings: bool = False,
    source_type: str = "F32",
    attn_v_index: int | None = None,
    n_attn_v: int | None = None,
    ffn_down_index: int | None = None,
) -> str:
    """The GGUF type llama-quantize writes tensor `name` (torch `shape`, now `source_type`) as under `preset`.

    n_layers: the block count (MTP layers included); tied_embeddings: the file has no output.weight.
    attn_v_index / n_attn_v: this tensor's position among, and the number of, the attn_v-like tensors in file
    order; ffn_down_index: its position among the ffn_down tensors (used without experts). Each defaults to
    what a Qwen3.5-family file gives: the layer of the name, and n_layers.
    """
    if preset not in DEFAULT_TYPE:
        raise DeltaspecError(f"Unknown quantization preset {preset!r}; the presets are {', '.join(DEFAULT_TYPE)}.")
    if not allows_quantization(name, shape):
        return source_type
    default = DEFAULT_TYPE[preset]
    kind = category(name)
    cols = shape[-1]
    chosen = default
    if kind == "output" or (kind == "token_embd" and tied_embeddings):
        if cols % format_of(default).block_size != 0 or default == "Q8_0":
            chosen = "Q8_0"
        else:
            chosen = "Q6_K"
    elif kind == "attn_v":
        index = _layer_or(name, attn_v_index)
        if preset in ("Q4_K_M", "Q5_K_M") and use_more_bits(index, n_layers if n_attn_v is None else n_attn_v):
            chosen = "Q6_K"
        if n_expert == 8:
            chosen = "Q8_0"
    elif kind == "attn_k" and n_expert == 8:
        chosen = "Q8_0"
    elif kind == "ffn_down":
        index = _layer_or(name, None if n_expert > 1 else ffn_down_index)
        if n_expert > 1 and not 0 <= index < n_layers:
            raise DeltaspecError(f"Tensor {name} names layer {index}, but the model has {n_layers} layers.")
        if preset in ("Q4_K_M", "Q5_K_M") and use_more_bits(index, n_layers):
            chosen = "Q6_K"
    elif kind == "attn_output" and n_expert == 8 and preset == "Q4_K_M":
        chosen = "Q5_K"
    return _fallback(chosen, cols)


def _layer_or(name: str, index: int | None) -> int:
    """`index`, or the layer in the tensor's name when index is None."""
    if index is not None:
        return index
    layer = layer_of(name)
    if layer is None:
        raise DeltaspecError(f"Cannot tell the layer of tensor {name}, which is not named blk.N.*.")
    return layer


def _fallback(qtype: str, cols: int) -> str:
    """tensor_type_fallback: keep qtype if its blocks divide the row, else its 32-element stand-in, else F16."""
    if cols % format_of(qtype).block_size == 0:
        return qtype
    stand_in = FALLBACK.get(qtype, qtype)
    return stand_in if cols % format_of(stand_in).block_size == 0 else "F16"


def preset_types(
    preset: str, tensors: Iterable[tuple[str, tuple[int, ...], str]], *, n_layers: int, n_expert: int = 0
) -> dict[str, str]:
    """llama-quantize's choice for every tensor of a file: (name, torch shape, type now) -> {name: type}.

    Replays its order (llama_model_loader's weights_map: by layer, tensors outside blocks first, then by
    name) and its counters: the attn_v-like tensors are numbered in that order among all of them, the ffn_down
    ones among those it quantizes.
    """
    ordered = sorted(tensors, key=lambda t: (-1 if layer_of(t[0]) is None else layer_of(t[0]), t[0]))
    names = [name for name, _, _ in ordered]
    n_attn_v = sum(category(name) == "attn_v" for name in names)
    tied = "output.weight" not in names
    attn_v_index = ffn_down_index = 0
    chosen: dict[str, str] = {}
    for name, shape, source_type in ordered:
        chosen[name] = preset_type(
            preset,
            name,
            shape,
            n_layers=n_layers,
            n_expert=n_expert,
            tied_embeddings=tied,
            source_type=source_type,
            attn_v_index=attn_v_index,
            n_attn_v=n_attn_v,
            ffn_down_index=ffn_down_index,
        )
        if allows_quantization(name, shape):
            attn_v_index += category(name) == "attn_v"
            ffn_down_index += category(name) == "ffn_down"
    return chosen
