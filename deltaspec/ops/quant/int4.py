"""The int4 group blocks (`I4_G32`, `I4_G128`): the weights of W4A16 checkpoints (compressed-tensors
`pack-quantized`, GPTQ) as deltaspec keeps them.

Such a checkpoint stores 4-bit integers q, one scale s per row and group of G input columns (G = 32 or 128)
and, when asymmetric, one integer zero point z per row and group; the weight is s * (q - z). deltaspec keeps
each group of a row as one block: a 4-byte header (s as its 16 stored bits, z as a byte, one byte saying
whether s is a bfloat16 (0) or a float16 (1)) and the G / 2 bytes of nibbles, value 2i in the low nibble of
byte i and 2i + 1 in the high one. The nibbles are the unsigned q' = q + 8 of compressed-tensors (which packs
signed q in [-8, 7] so) and GPTQ's q alike, with z shifted to match (8 + z, or 8 when symmetric; GPTQ's
stored zero + 1 in its original `gptq` format, as stored in `gptq_v2`), so every block is s * (q' - z'), exact
in float32 (s carries at most 11 significant bits, q' - z' at most 5). Rows, fusions, shards and expert stacks
of GGUF weights hold these blocks unchanged.

A matrix quantized in activation order (GPTQ's `desc_act`, compressed-tensors' `actorder: group`) assigns its
groups in another order of the input columns, which its group indices `g_idx` [in] record: column c belongs
to group g_idx[c]. deltaspec stores such a matrix's columns sorted by group (`stored_order`), so that every
group is again a run of G stored columns, and multiplies stored column j by input feature order[j] (the
weight's `input_order`), as vLLM's kernels sort by `g_idx`.

`compressed_to_blocks` and `gptq_to_blocks` convert a checkpoint's tensors; `quantize_int4` writes the blocks
from a float matrix (random weights, test fixtures) as a symmetric W4A16 quantizer does (s = amax / 7.5 in
bfloat16, q = round(w / s) clamped to [-8, 7]).
"""

from __future__ import annotations

import torch

from deltaspec.errors import DeltaspecError

GROUP_TYPES = {32: "I4_G32", 128: "I4_G128"}  # group size -> block type
HEADER = 4  # bytes: scale bits (2), zero point (1), scale type (1)
BFLOAT16, FLOAT16 = 0, 1  # the header's scale type
SCALE_TYPES = {torch.bfloat16: BFLOAT16, torch.float16: FLOAT16}
SYMMETRIC_ZERO = 8  # z' of a symmetric checkpoint: q' - 8 = q


def block_bytes(group: int) -> int:
    return HEADER + group // 2


def _pack(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """nibble bytes [..., rows, in / 2], scales [..., rows, in / G] (bfloat16 or float16) and zero points
    [..., rows, in / G] (integers 0..16) -> blocks uint8 [..., rows, in / G * (4 + G / 2)]."""
    if scale.dtype not in SCALE_TYPES:
        raise DeltaspecError(f"int4 group scales are bfloat16 or float16, not {scale.dtype}.")
    groups = scale.shape[-1]
    if nibbles.shape[-1] != groups * group // 2:
        raise DeltaspecError(
            f"An int4 matrix with {nibbles.shape[-1] * 2} input columns does not have {groups} groups of {group}."
        )
    header = torch.empty((*scale.shape, HEADER), dtype=torch.uint8, device=scale.device)
    header[..., :2] = scale.contiguous().view(torch.uint8).unflatten(-1, (groups, 2))
    header[..., 2] = zero.to(torch.uint8)
    header[..., 3] = SCALE_TYPES[scale.dtype]
    values = nibbles.to(scale.device).unflatten(-1, (groups, group // 2))
    return torch.cat([header, values], dim=-1).flatten(-2)


def stored_order(g_idx: torch.Tensor | None, group: int, name: str) -> torch.Tensor | None:
    """The input feature of each stored column (int64 [in]) of a matrix whose column c belongs to group
    g_idx[c]: None when each group is G consecutive columns (or there is no g_idx), else the columns sorted by
    group. Refused when a group does not have G columns."""
    if g_idx is None:
        return None
    groups = g_idx.to(torch.int64)
    consecutive = torch.arange(groups.numel()) // group
    if torch.equal(groups, consecutive):
        return None
    order = torch.argsort(groups, stable=True)
    if not torch.equal(groups[order], consecutive):
        raise DeltaspecError(
            f"The group indices (g_idx) of {name} do not give every group {group} input columns; the checkpoint "
            "is damaged or not of int4 groups of that size."
        )
    return order


def _nibble_bytes(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """4-bit values int32 [out, in] (columns taken in `order` if given) -> bytes uint8 [out, in / 2], value 2i
    in the low nibble of byte i."""
    if order is not None:
        values = values[:, order]
    return (values[..., 0::2] | (values[..., 1::2] << 4)).to(torch.uint8)


def compressed_to_blocks(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors `pack-quantized` int4 tensors of one matrix [out, in] -> blocks: `weight_packed` int32
    [out, in / 8] (q + 8 in nibbles, packed along the input), `weight_scale` [out, in / G] and, asymmetric,
    the zero points z in [-8, 7] already unpacked to integers [out, in / G] (the checkpoint packs them along
    the output dimension: `unpack_zero_points`); the columns stored in `order` (`stored_order`) if given."""
    zero = torch.full(scale.shape, SYMMETRIC_ZERO) if zero_point is None else zero_point.to(torch.int32) + 8
    if order is None:
        return _pack(packed.contiguous().view(torch.uint8), scale, zero, group)
    return _pack(_nibble_bytes(_nibbles_of(packed.contiguous()), order), scale, zero, group)


def unpack_zero_points(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """compressed-tensors' int4 zero points int32 [ceil(out / 8), groups], packed along the output dimension
    (row 8w + j in bits 4j of word w, stored + 8) -> signed integers [out, groups]."""
    nibbles = _nibbles_of(packed.t().contiguous())  # [groups, 8 * ceil(out / 8)]
    return (nibbles[:, :rows] - 8).t()


def _nibbles_of(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their eight nibbles each, lowest first, as int32 [..., 8n]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def gptq_to_blocks(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    zero_offset: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """GPTQ int4 tensors of one matrix [out, in] -> blocks: `qweight` int32 [in / 8, out] (input 8w + j of each
    output column in bits 4j of word w), `qzeros` int32 [in / G, out / 8] (output 8w + j in bits 4j), `scales`
    [in / G, out]; the zero point is the stored one plus `zero_offset` (1 in the original `gptq` format); the
    columns stored in `order` (`stored_order`) if given."""
    values = _nibbles_of(qweight.t().contiguous())  # [out, in]: q in 0..15
    zero = _nibbles_of(qzeros)[:, : scales.shape[1]].t() + zero_offset  # [out, in / G]
    return _pack(_nibble_bytes(values, order), scales.t(), zero, group)


def quantize_int4(weight: torch.Tensor, group: int) -> torch.Tensor:
    """weight [rows, cols] float -> symmetric int4 blocks of `group` columns: s = amax / 7.5 in bfloat16 (1 for
    an all-zero group), q = round(w / s) clamped to [-8, 7]."""
    rows, columns = weight.shape
    if columns % group:
        raise DeltaspecError(f"int4 groups of {group} need input sizes divisible by {group}, not {columns}.")
    groups = weight.to(torch.float32).view(rows, columns // group, group)
    amax = groups.abs().amax(dim=-1)  # [rows, groups]
    scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int32) + 8  # [rows, groups, group]
    return _pack(
        _nibble_bytes(q.view(rows, columns), None),
        scale,
        torch.full_like(amax, SYMMETRIC_ZERO, dtype=torch.int32),
        group,
    )


def quantize_i4_g32(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """`deltaspec.ops.quant.quantize`'s I4_G32 entry (`importance` does not change it)."""
    return quantize_int4(x, 32)


def quantize_i4_g128(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """`deltaspec.ops.quant.quantize`'s I4_G128 entry (`importance` does not change it)."""
    return quantize_int4(x, 128)
