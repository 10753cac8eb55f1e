"""Hugging Face quantized checkpoints: which `quantization_config`s deltaspec loads, how their tensors are
named, and this rank's part of a quantized matrix as blocks.

Loaded:
- `quant_method: fp8` with `weight_block_size: [128, 128]` and dynamic activations (Qwen's and DeepSeek's
  `-FP8` releases): a matrix `<p>.weight` with a `<p>.weight_scale_inv` companion is float8 e4m3 values with
  one float32 scale per 128 x 128 tile and becomes `FP8_B128` blocks (`deltaspec.ops.quant.fp8`);
- `quant_method: compressed-tensors` in the `pack-quantized` format with 4-bit integer weights in groups of 32
  or 128 and unquantized activations (W4A16, symmetric or asymmetric): `<p>.weight_packed` with
  `weight_scale`, `weight_shape` and, asymmetric, `weight_zero_point`;
- `quant_method: gptq`, 4 bits, groups of 32 or 128, in the `gptq` or `gptq_v2` checkpoint format:
  `<p>.qweight` with `qzeros`, `scales` and `g_idx`;
both int4 kinds become `I4_G32` / `I4_G128` blocks (`deltaspec.ops.quant.int4`); a matrix quantized in
activation order (its `g_idx` / `weight_g_idx` not column // G) keeps its columns sorted by group and reads its
input in that order (`int4.stored_order`). Tensors without a
quantized layout (embeddings, norms, routers, whatever the checkpoint kept in bf16) load as float weights.
Every other method or variant is refused in one sentence naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.checkpoint_layout import COMPANIONS, main_tensor, weight_name
from deltaspec.ops.quant.fp8 import BLOCK, tiles_to_blocks
from deltaspec.ops.quant.fp8 import QTYPE as FP8_QTYPE
from deltaspec.ops.quant.int4 import (
    GROUP_TYPES,
    compressed_to_blocks,
    gptq_to_blocks,
    stored_order,
    unpack_zero_points,
)
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.parallel.shard import Shard

LOADED = (
    "FP8 block-scaled checkpoints (quant_method fp8, weight_block_size [128, 128]), int4 W4A16 ones "
    "(compressed-tensors pack-quantized or GPTQ, groups of 32 or 128), unquantized ones, GGUF files"
)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: `method` ("fp8", "compressed-tensors" or "gptq"); for the int4 ones the
    `group` size and the `zero_offset` added to GPTQ's stored zero points (1 in the original `gptq` format)."""

    method: str
    group: int = BLOCK
    zero_offset: int = 0

    @property
    def main_suffix(self) -> str:
        return {"fp8": "weight", "compressed-tensors": "weight_packed", "gptq": "qweight"}[self.method]


def checkpoint_quantization(raw_config: dict, model_dir: Path) -> Quantization | None:
    """The checkpoint's quantization (None for an unquantized one); any other is refused in one sentence."""
    config = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        return _fp8(config, model_dir)
    if method == "compressed-tensors":
        return _compressed_tensors(config, model_dir)
    if method == "gptq":
        return _gptq(config, model_dir)
    raise DeltaspecError(f"{model_dir} is quantized with {method!r}, which deltaspec does not load; it loads {LOADED}.")


def _fp8(config: dict, model_dir: Path) -> Quantization:
    block = config.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise DeltaspecError(
            f"{model_dir} is an FP8 checkpoint with weight_block_size {block} (per-tensor scales when absent); "
            f"deltaspec loads {LOADED}."
        )
    fmt, scheme = config.get("fmt", "e4m3"), config.get("activation_scheme", "dynamic")
    if fmt != "e4m3" or scheme != "dynamic":
        raise DeltaspecError(
            f"{model_dir} is an FP8 checkpoint with {scheme!r} activation scales and {fmt!r} values; deltaspec "
            f"loads {LOADED}, with dynamic activation scales and e4m3 values."
        )
    return Quantization("fp8")


def _compressed_tensors(config: dict, model_dir: Path) -> Quantization:
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise DeltaspecError(f"{model_dir} is a compressed-tensors checkpoint without config_groups; {LOADED}.")
    schemes = []
    for scheme in groups:
        weights = scheme.get("weights") or {}
        fmt = scheme.get("format") or config.get("format")
        described = (
            f"{fmt} {weights.get('type')} {weights.get('num_bits')}-bit {weights.get('strategy')} weights"
            f"{' with quantized activations' if scheme.get('input_activations') else ''}"
        )
        if (
            fmt != "pack-quantized"
            or weights.get("type") != "int"
            or weights.get("num_bits") != 4
            or weights.get("strategy") != "group"
            or weights.get("group_size") not in GROUP_TYPES
            or scheme.get("input_activations")
        ):
            raise DeltaspecError(
                f"{model_dir} is a compressed-tensors checkpoint of {described} (group size "
                f"{weights.get('group_size')}); deltaspec loads {LOADED}."
            )
        schemes.append(weights["group_size"])
    if len(set(schemes)) != 1:
        raise DeltaspecError(
            f"{model_dir} mixes int4 group sizes {sorted(set(schemes))}; deltaspec loads one group size per checkpoint."
        )
    return Quantization("compressed-tensors", group=schemes[0])


def _gptq(config: dict, model_dir: Path) -> Quantization:
    bits, group = config.get("bits"), config.get("group_size")
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if bits != 4 or group not in GROUP_TYPES or checkpoint_format not in ("gptq", "gptq_v2"):
        raise DeltaspecError(
            f"{model_dir} is a GPTQ checkpoint of {bits}-bit weights in groups of {group} ({checkpoint_format} "
            f"format); deltaspec loads {LOADED}, in the gptq or gptq_v2 format."
        )
    return Quantization("gptq", group=group, zero_offset=1 if checkpoint_format == "gptq" else 0)


def fp8_part(name: str, source, scale_inv: torch.Tensor, target: str, shape: torch.Size, shard: Shard) -> torch.Tensor:
    """`shard`'s part of the FP8 matrix `name` (a safetensors slice `source`, full `shape` [out, in], tile scales
    `scale_inv`) as FP8_B128 blocks uint8 [rows, in_part / 128 * 132]: only the rank's rows or columns are read;
    a column split must keep whole 128-value blocks."""
    if scale_inv.dtype not in (torch.float32, torch.bfloat16):
        raise DeltaspecError(f"The scales of {name} are {scale_inv.dtype}; deltaspec reads float32 FP8 tile scales.")
    pieces = shard.pieces(target, shape)
    if pieces is None:
        return tiles_to_blocks(source[:], scale_inv)
    dim, spans = pieces
    parts = []
    for start, stop in spans:
        if dim == 0:
            parts.append(tiles_to_blocks(source[start:stop], scale_inv, first_row=start))
            continue
        _check_column_split(name, start, stop, BLOCK, shard)
        parts.append(tiles_to_blocks(source[:, start:stop], scale_inv[:, start // BLOCK : stop // BLOCK]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1 if dim == 1 else 0)


def _check_column_split(name: str, start: int, stop: int, block: int, shard: Shard) -> None:
    if start % block or stop % block:
        raise DeltaspecError(
            f"The quantized tensor {name} cannot be split among {shard.size} ranks without cutting a block of "
            f"{block} inputs; run it on fewer GPUs."
        )


def int4_part(name: str, blocks: torch.Tensor, group: int, target: str, shape: torch.Size, shard: Shard, ordered: bool):
    """`shard`'s rows, or whole groups of input columns, of the int4 matrix `name` (full `shape` [out, in]) whose
    blocks are `blocks` [out, in / G * (4 + G / 2)]; `ordered`: its columns are stored in activation order, where
    a rank's input columns do not make whole groups."""
    pieces = shard.pieces(target, shape)
    if pieces is None:
        return blocks
    dim, spans = pieces
    if ordered and dim == 1:
        raise DeltaspecError(
            f"{name} is quantized in activation order: its groups mix input columns that {shard.size} ranks would "
            "each hold a part of, so it cannot be split by input columns; run it on one GPU."
        )
    per_group = blocks.shape[-1] // (shape[-1] // group)
    parts = []
    for start, stop in spans:
        if dim == 0:
            parts.append(blocks[start:stop])
            continue
        _check_column_split(name, start, stop, group, shard)
        parts.append(blocks[:, start // group * per_group : stop // group * per_group])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1 if dim == 1 else 0)


class Blocks:
    """The quantized matrices of one rank's load of a checkpoint quantized as `quantization` (None: unquantized;
    `files`: the checkpoint's tensor -> file map): each as blocks, per-expert ones gathered into their layer's
    stacks on `device`; `weights` gives them as `QuantizedWeight`s by parameter name. `params` and `shapes` are
    the rank's and the full model's parameters."""

    def __init__(
        self,
        files: dict[str, Path],
        quantization: Quantization | None,
        shard: Shard,
        params: dict,
        shapes: dict,
        device: torch.device,
    ):
        self.files, self.quantization, self.shard = files, quantization, shard
        self.params, self.shapes, self.device = params, shapes, device
        # parameter -> (block type, blocks [rows, bytes], the input feature of each stored column or None)
        self.plain: dict[str, tuple[str, torch.Tensor, torch.Tensor | None]] = {}
        self.stacks: dict[str, tuple[str, torch.Tensor]] = {}  # fused expert parameter -> [held experts, rows, bytes]

    def skipped(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is read along with its matrix rather than on its own."""
        return self.quantization is not None and main_tensor(name, self.files) is not None

    def _companion(self, name: str, suffix: str) -> torch.Tensor | None:
        companion = f"{name.rpartition('.')[0]}.{suffix}"
        if companion not in self.files:
            return None
        with safe_open(self.files[companion], framework="pt", device="cpu") as f:
            return f.get_tensor(companion)

    def _is_quantized(self, name: str) -> bool:
        q = self.quantization
        if q is None or not name.endswith("." + q.main_suffix):
            return False
        return q.method != "fp8" or self._has(name, COMPANIONS["weight"][0])

    def _has(self, name: str, suffix: str) -> bool:
        return f"{name.rpartition('.')[0]}.{suffix}" in self.files

    def _part(self, name: str, source, target: str, shape: torch.Size) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        """(block type, `shard`'s part of matrix `name` as blocks, the input feature of each stored column or None);
        `target` names it for the shard."""
        q = self.quantization
        if q.method == "fp8":
            scale_inv = self._companion(name, COMPANIONS["weight"][0])
            return FP8_QTYPE, fp8_part(name, source, scale_inv, target, shape, self.shard), None
        if q.method == "compressed-tensors":
            blocks, order = self._compressed(name, source[:], shape)
        else:
            blocks, order = self._gptq(name, source[:], shape)
        part = int4_part(name, blocks, q.group, target, shape, self.shard, order is not None)
        return GROUP_TYPES[q.group], part, order

    def _shape_error(self, name: str, stored, shape: torch.Size) -> DeltaspecError:
        return DeltaspecError(
            f"Tensor {name} has shape {list(stored)} in the checkpoint but the config implies int4 blocks of a "
            f"{list(shape)} matrix in groups of {self.quantization.group}; config.json and the weights do not "
            "belong together."
        )

    def _compressed(
        self, name: str, packed: torch.Tensor, shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, columns = shape
        scale = self._companion(name, "weight_scale")
        if packed.shape != (rows, columns // 8) or scale is None or scale.shape != (rows, columns // self.group):
            raise self._shape_error(name, packed.shape, shape)
        order = stored_order(self._companion(name, "weight_g_idx"), self.group, name)
        zero_point = self._companion(name, "weight_zero_point")
        zero = None if zero_point is None else unpack_zero_points(zero_point, rows)
        return compressed_to_blocks(packed, scale, zero, self.group, order), order

    def _gptq(self, name: str, qweight: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, columns = shape
        scales, qzeros = self._companion(name, "scales"), self._companion(name, "qzeros")
        if (
            qweight.shape != (columns // 8, rows)
            or scales is None
            or scales.shape != (columns // self.group, rows)
            or qzeros is None
        ):
            raise self._shape_error(name, qweight.shape, shape)
        order = stored_order(self._companion(name, "g_idx"), self.group, name)
        return gptq_to_blocks(qweight, qzeros, scales, self.group, self.quantization.zero_offset, order), order

    @property
    def group(self) -> int:
        return self.quantization.group

    def add(self, name: str, target: str, source) -> bool:
        """Keep checkpoint matrix `name` (parameter `target`) as blocks if it is quantized; False if it is not."""
        if not self._is_quantized(name):
            return False
        self.plain[target] = self._part(name, source, target, self.shapes[target])
        return True

    def add_expert(self, match: re.Match, name: str, source, expert_parts: dict[str, set]) -> bool:
        """Put per-expert quantized matrix `name` (`match`: prefix, expert, projection of its weight name) in its
        layer's stack, if the rank holds the expert; False if it is not quantized."""
        if not self._is_quantized(name):
            return False
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
        full, held = self.shapes[fused], self.params[fused].shape  # [E, rows, in] whole and this rank's
        if not 0 <= expert < full[0]:
            raise DeltaspecError(f"Tensor {name} names expert {expert}, but config.json has {full[0]} experts.")
        local = self.shard.held_expert(expert)
        if local is None:  # expert parallelism: another rank's
            return True
        one = torch.Size((full[1] // 2, full[2]) if proj != "down_proj" else full[1:])  # one expert's, unsharded
        qtype, data, order = self._part(name, source, weight_name(name), one)
        if order is not None:
            raise DeltaspecError(
                f"{name} is an expert quantized in activation order; deltaspec multiplies a layer's experts as one "
                "stack read in one input order, so it loads experts whose groups are consecutive input columns."
            )
        if fused not in self.stacks:
            self.stacks[fused] = qtype, torch.empty((*held[:2], data.shape[-1]), dtype=torch.uint8, device=self.device)
        half = held[1] // 2
        rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None), "down_proj": slice(None)}[proj]
        self.stacks[fused][1][local, rows].copy_(data)
        expert_parts[fused].add((local, proj))
        return True

    def weights(self) -> dict[str, QuantizedWeight]:
        """Every quantized matrix read, as blocks on the device, by parameter name."""
        weights = {
            target: QuantizedWeight(
                [(qtype, data.to(self.device))],
                self.params[target].shape[-1],
                None if order is None else order.to(self.device),
            )
            for target, (qtype, data, order) in self.plain.items()
        }
        for target, (qtype, data) in self.stacks.items():
            weights[target] = QuantizedWeight([(qtype, data.to(self.device))], self.params[target].shape[-1])
        return weights
