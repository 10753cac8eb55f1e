"""Hugging Face quantized checkpoints: which `quantization_config`s deltaspec loads, and this rank's part of an
FP8 tensor as blocks.

Loaded: `quant_method: fp8` with `weight_block_size: [128, 128]` and dynamic activations (Qwen's and DeepSeek's
`-FP8` releases): a matrix with a `<name>_scale_inv` companion is float8 e4m3 values with one float32 scale per
128 x 128 tile and becomes `FP8_B128` blocks (`deltaspec.ops.quant.fp8`); tensors without one (embeddings, norms,
routers, whatever the checkpoint left in bf16) load as float weights. Every other method is refused in one
sentence naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.fp8 import BLOCK, QTYPE, SCALE_SUFFIX, tiles_to_blocks
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.parallel.shard import Shard

LOADED = "FP8 block-scaled checkpoints (quant_method fp8, weight_block_size [128, 128]), unquantized ones, GGUF files"


def checkpoint_quantization(raw_config: dict, model_dir: Path) -> str | None:
    """ "fp8" for an FP8 block-scaled checkpoint, None for an unquantized one; any other is refused."""
    config = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != "fp8":
        raise DeltaspecError(
            f"{model_dir} is quantized with {method!r}, which deltaspec does not load; it loads {LOADED}."
        )
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
    return "fp8"


def scale_name(name: str) -> str:
    """The checkpoint name of the tile scales of weight `name`."""
    return name + SCALE_SUFFIX


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
        if start % BLOCK or stop % BLOCK:
            raise DeltaspecError(
                f"The FP8 tensor {name} cannot be split among {shard.size} ranks without cutting a block of "
                f"{BLOCK} inputs; run it on fewer GPUs."
            )
        parts.append(tiles_to_blocks(source[:, start:stop], scale_inv[:, start // BLOCK : stop // BLOCK]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1 if dim == 1 else 0)


class Blocks:
    """The FP8 matrices of one rank's load (`files`: the checkpoint's tensor -> file map, empty for an unquantized
    checkpoint): each matrix with tile scales as blocks, per-expert ones gathered into their layer's stacks on
    `device`; `weights` gives them as `QuantizedWeight`s by parameter name. `params` and `shapes` are the rank's
    and the full model's parameters."""

    def __init__(self, files: dict[str, Path], shard: Shard, params: dict, shapes: dict, device: torch.device):
        self.files, self.shard, self.params, self.shapes, self.device = files, shard, params, shapes, device
        self.plain: dict[str, torch.Tensor] = {}  # parameter -> blocks [rows, bytes]
        self.stacks: dict[str, torch.Tensor] = {}  # fused expert parameter -> blocks [held experts, rows, bytes]

    def _scales(self, name: str) -> torch.Tensor:
        with safe_open(self.files[scale_name(name)], framework="pt", device="cpu") as f:
            return f.get_tensor(scale_name(name))

    def add(self, name: str, target: str, source) -> bool:
        """Keep checkpoint matrix `name` (parameter `target`) as blocks if it is FP8; False if it is not."""
        if scale_name(name) not in self.files:
            return False
        self.plain[target] = fp8_part(name, source, self._scales(name), target, self.shapes[target], self.shard)
        return True

    def add_expert(self, match: re.Match, name: str, source, expert_parts: dict[str, set]) -> bool:
        """Put per-expert FP8 matrix `name` (`match`: prefix, expert, projection) in its layer's stack, if the rank
        holds the expert; False if it is not FP8."""
        if scale_name(name) not in self.files:
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
        data = fp8_part(name, source, self._scales(name), name, one, self.shard)
        if fused not in self.stacks:
            self.stacks[fused] = torch.empty((*held[:2], data.shape[-1]), dtype=torch.uint8, device=self.device)
        half = held[1] // 2
        rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None), "down_proj": slice(None)}[proj]
        self.stacks[fused][local, rows].copy_(data)
        expert_parts[fused].add((local, proj))
        return True

    def weights(self) -> dict[str, QuantizedWeight]:
        """Every FP8 matrix read, as blocks on the device, by parameter name."""
        return {
            target: QuantizedWeight([(QTYPE, data.to(self.device))], self.params[target].shape[-1])
            for target, data in (*self.plain.items(), *self.stacks.items())
        }
