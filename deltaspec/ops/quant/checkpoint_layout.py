"""How Hugging Face quantized checkpoints name a quantized matrix's tensors, and the bytes the matrix takes as
deltaspec's blocks (what the loader, `deltaspec.model.hf_quant`, and the memory planner both need).

FP8 (`quant_method: fp8`): `<p>.weight` float8 e4m3 with its tile scales `<p>.weight_scale_inv`. compressed-tensors
`pack-quantized`: `<p>.weight_packed` int32 with `weight_scale`, `weight_shape`, maybe `weight_zero_point` and
`weight_g_idx`. GPTQ: `<p>.qweight` int32 with `qzeros`, `scales`, `g_idx`.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from deltaspec.ops.quant.formats import format_of
from deltaspec.ops.quant.fp8 import QTYPE as FP8_QTYPE
from deltaspec.ops.quant.fp8 import SCALE_SUFFIX
from deltaspec.ops.quant.int4 import HEADER

# a quantized matrix's main tensor suffix -> the suffixes of its companions (the first one marks an FP8 matrix)
COMPANIONS = {
    "weight": ("weight" + SCALE_SUFFIX,),
    "weight_packed": ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "qweight": ("qzeros", "scales", "g_idx"),
}
SCALES = {"weight_packed": "weight_scale", "qweight": "scales"}  # an int4 matrix's group scales


def main_tensor(name: str, files: dict[str, Path]) -> str | None:
    """The quantized matrix tensor that checkpoint tensor `name` is a companion of (None if it is none's)."""
    prefix, _, suffix = name.rpartition(".")
    for main, companions in COMPANIONS.items():
        if suffix in companions and f"{prefix}.{main}" in files:
            return f"{prefix}.{main}"
    return None


def weight_name(name: str) -> str:
    """The `<p>.weight` a quantized matrix's main tensor `<p>.weight_packed` / `<p>.qweight` stands for."""
    prefix, _, suffix = name.rpartition(".")
    return f"{prefix}.weight" if suffix in SCALES else name


def stored_bytes(name: str, shape: list[int], dtype: str, files: dict[str, Path]) -> int | None:
    """The bytes a quantized matrix's main tensor `name` (its safetensors `shape` and `dtype`) takes as blocks,
    None for any other tensor: FP8 as FP8_B128 (132 bytes per 128 values), int4 as its nibbles plus one
    4-byte header per group."""
    count = 1
    for size in shape:
        count *= size
    if dtype == "F8_E4M3":
        fmt = format_of(FP8_QTYPE)
        return count * fmt.type_size // fmt.block_size
    prefix, _, suffix = name.rpartition(".")
    if suffix not in SCALES or dtype != "I32":
        return None
    scales = f"{prefix}.{SCALES[suffix]}"
    with safe_open(files[scales], framework="pt") as f:
        groups = 1
        for size in f.get_slice(scales).get_shape():
            groups *= size
    return count * 4 + groups * HEADER
