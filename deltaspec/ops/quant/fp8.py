"""The FP8 block format (`FP8_B128`): Hugging Face FP8 checkpoints' weights as deltaspec keeps them.

A checkpoint of `quant_method: fp8` with `weight_block_size: [128, 128]` (Qwen's and DeepSeek's `-FP8`
releases) stores each quantized matrix as float8 e4m3 values `weight` [out, in] and one float32
`weight_scale_inv` per 128 x 128 tile [ceil(out / 128), in / 128]; the matrix is value * its tile's scale.
deltaspec stores each row as blocks of (its tile's scale, 128 e4m3 bytes) (`deltaspec.ops.quant.formats`), so
every path of GGUF weights (fused projections, tensor-parallel shards, expert stacks, the reference product)
takes it as one more block type. `tiles_to_blocks` packs a checkpoint's tensors; `quantize_tiles` writes that
layout from a float matrix (random weights and test fixtures), as transformers' FP8 quantizer does: scale =
amax / 448 per tile, value = (w / scale) rounded to e4m3.
"""

from __future__ import annotations

import torch

from deltaspec.errors import DeltaspecError

QTYPE = "FP8_B128"  # the block type's name (`deltaspec.ops.quant.formats`)
BLOCK = 128  # values per block, and the tile's side
BLOCK_BYTES = 4 + BLOCK  # its float32 scale and its e4m3 values
SCALE_SUFFIX = "_scale_inv"  # a checkpoint's `...weight_scale_inv`: the tile scales of `...weight`
E4M3_MAX = 448.0  # the largest finite float8 e4m3 value


def tiles_to_blocks(values: torch.Tensor, scale_inv: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """values [..., rows, in] float8_e4m3fn (or its bytes), rows first_row.. of a matrix whose 128 x 128 tiles have
    scales scale_inv [..., tiles_out, in / 128] float32 -> uint8 [..., rows, in / 128 * 132] blocks."""
    rows, columns = values.shape[-2:]
    if columns % BLOCK:
        raise DeltaspecError(
            f"An FP8 weight with {columns} input columns cannot be kept as blocks of {BLOCK}; deltaspec loads FP8 "
            f"checkpoints whose quantized matrices have input sizes divisible by {BLOCK}."
        )
    tile_rows = torch.arange(first_row, first_row + rows, device=scale_inv.device) // BLOCK
    scales = scale_inv.to(torch.float32).index_select(-2, tile_rows)[..., : columns // BLOCK]  # [..., rows, in/128]
    return _pack(values, scales.to(values.device))


def quantize_tiles(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (values [out, in] float8_e4m3fn, weight_scale_inv [ceil(out/128), in/128]
    float32): each 128 x 128 tile scaled by amax / 448 (1 for an all-zero tile)."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise DeltaspecError(f"FP8 tiles need input sizes divisible by {BLOCK}, not {in_features}.")
    tiles_out = -(-out_features // BLOCK)
    padded = torch.zeros(tiles_out * BLOCK, in_features, dtype=torch.float32, device=weight.device)
    padded[:out_features] = weight.to(torch.float32)
    tiles = padded.view(tiles_out, BLOCK, in_features // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))  # [tiles_out, in/128]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(tiles_out * BLOCK, in_features)[:out_features], scale


def quantize_runs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float (cols a multiple of 128) -> (values [rows, cols] float8_e4m3fn, scales [rows, cols / 128]
    float32): each row's every 128 values scaled by their amax / 448 (1 for an all-zero run) and rounded to nearest
    e4m3, all in float32 arithmetic (FP8_B128 rows, and `--fp8-activations dynamic`'s activations)."""
    rows, columns = x.shape
    runs = x.to(torch.float32).view(rows, columns // BLOCK, BLOCK)
    amax = runs.abs().amax(dim=-1)  # [rows, cols/128]
    # divided by a tensor: CUDA torch multiplies by the reciprocal of a scalar divisor, which is not always the quotient
    scales = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    values = (runs / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(rows, columns), scales


def quantize_fp8_b128(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """`deltaspec.ops.quant.quantize`'s FP8_B128 entry: rows [rows, cols] -> blocks of `quantize_runs` (a row of a
    128 x 128 tile: the checkpoint format's bytes, finer scales; `importance` does not change it)."""
    return _pack(*quantize_runs(x))


def _pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., rows, in] e4m3 (or its bytes) and one float32 scale per row and block [..., rows, in / 128]
    -> uint8 blocks [..., rows, in / 128 * 132]."""
    blocks = values.shape[-1] // BLOCK
    value_bytes = values.contiguous().view(torch.uint8).unflatten(-1, (blocks, BLOCK))
    scale_bytes = scales.to(torch.float32).contiguous().view(torch.uint8).unflatten(-1, (blocks, 4))
    return torch.cat([scale_bytes, value_bytes], dim=-1).flatten(-2)
